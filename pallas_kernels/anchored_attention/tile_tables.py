"""Tile tables: which context tiles each query tile must visit, and which of them need no mask.

Computed in plain jax outside the kernels from the mask's small arrays (never a dense mask).
A query q (slot of block j) sees a subset of ``[doc_first(d_j), a_j)`` where ``doc_first(d)`` is
the first context entry of document d; all of ``[run_start(a_j - 1), a_j)`` when the entry just
before the anchor is in the block's document (the contiguous run of that document up to the
anchor). For a tile of ``block_q`` queries this gives, in units of ``block_k`` context tiles::

    lo <= f0 <= f1 <= hi          visit [lo, hi); tiles in [f0, f1) are visible to every query

Example: T=16, block_k=4, one document from 0, a tile of slots of anchors (9, 11)::

    context tile     0    1    2    3
    entries        0-3  4-7  8-11 12-15
    anchor 9:      xxxx xxxx x...
    anchor 11:     xxxx xxxx xxx.
    -> lo=0, f0=0, f1=2 (tiles 0, 1 without mask), hi=3 (tile 2 masked), tile 3 skipped.

The tables are a *covering*: every visible pair lies in ``[lo, hi)`` for any input (unsorted
anchors, repeated document ids); sorted anchors and packed documents only make it tight. A sliding
window narrows visibility further; its tiles are all run with the mask (``f0 == f1``).

The dk/dv kernel walks the transpose: for each context tile, the query tiles ``[i_lo, i_hi)`` that
visit it, ``[g0, g1)`` of them without mask (empty unless that set is contiguous).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_BIG = 2**30


def cdiv(a, b):
    return -(-a // b)


class QueryTiles(NamedTuple):
    """Per query tile ``[B, n_q_tiles]`` int32: visit context tiles [lo, hi), unmasked in [f0, f1)."""

    lo: jax.Array
    f0: jax.Array
    f1: jax.Array
    hi: jax.Array


class ContextTiles(NamedTuple):
    """Per context tile ``[B, n_k_tiles]`` int32: query tiles [i_lo, i_hi), unmasked in [g0, g1)."""

    i_lo: jax.Array
    g0: jax.Array
    g1: jax.Array
    i_hi: jax.Array


def per_anchor_ranges(ctx_segment_ids, anchors, anchor_segment_ids):
    """Per anchor ``[B, A]``: covering range [lo, hi) (lo >= hi: sees nothing) and the surely
    visible range [full_lo, hi) (full_lo = _BIG: none guaranteed)."""
    B, T = ctx_segment_ids.shape
    seg = ctx_segment_ids.astype(jnp.int32)
    idx = jnp.arange(T, dtype=jnp.int32)

    def bucket(d):  # ids outside [0, T) share bucket T: its first entry still covers them all
        return jnp.where((d >= 0) & (d < T), d, T)

    first = jnp.full((B, T + 1), T, jnp.int32)
    first = first.at[jnp.arange(B)[:, None], bucket(seg)].min(jnp.broadcast_to(idx, (B, T)))
    d = anchor_segment_ids.astype(jnp.int32)
    a = jnp.clip(anchors.astype(jnp.int32), 0, T)
    lo = jnp.take_along_axis(first, bucket(d), axis=1)
    sees = (d != 0) & (lo < a)
    lo = jnp.where(sees, lo, _BIG)
    hi = jnp.where(sees, a, 0)

    starts = (idx == 0)[None, :] | (seg != jnp.roll(seg, 1, axis=1))
    run_start = jax.lax.cummax(jnp.where(starts, idx[None, :], 0), axis=1)
    prev = jnp.clip(a - 1, 0, T - 1)
    run_ok = sees & (jnp.take_along_axis(seg, prev, axis=1) == d)
    full_lo = jnp.where(run_ok, jnp.take_along_axis(run_start, prev, axis=1), _BIG)
    return lo, full_lo, hi


def query_tiles(
    ctx_segment_ids, anchors, anchor_segment_ids, *, slots, block_q, block_k, n_q_tiles, window
) -> QueryTiles:
    """Tables for ``n_q_tiles`` tiles of ``block_q`` queries (query i belongs to anchor i // slots;
    queries past ``A * slots`` are padding and see nothing)."""
    B, A = anchors.shape
    lo, full_lo, hi = per_anchor_ranges(ctx_segment_ids, anchors, anchor_segment_ids)
    pad = n_q_tiles * block_q - A * slots

    def per_query(x, fill):
        x = jnp.repeat(x, slots, axis=1)
        return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(B, n_q_tiles, block_q)

    lo_q, hi_q = per_query(lo, _BIG), per_query(hi, 0)
    t_lo, t_hi = lo_q.min(-1), hi_q.max(-1)
    empty = t_lo >= t_hi
    lo_t = jnp.where(empty, 0, t_lo // block_k)
    hi_t = jnp.where(empty, 0, cdiv(t_hi, block_k))
    if window is not None:
        f0 = f1 = hi_t
    else:
        # Every query of the tile (padding included) must be surely visible: max of the starts,
        # min of the ends; a query with no guaranteed range makes the range empty.
        f_lo = per_query(full_lo, _BIG).max(-1)
        f_hi = hi_q.min(-1)
        f0 = jnp.clip(cdiv(jnp.minimum(f_lo, _BIG // 2), block_k), lo_t, hi_t)
        f1 = jnp.clip(f_hi // block_k, f0, hi_t)
    return QueryTiles(*(x.astype(jnp.int32) for x in (lo_t, f0, f1, hi_t)))


def context_tiles(qt: QueryTiles, n_k_tiles: int) -> ContextTiles:
    """The transpose of ``qt`` for the dk/dv kernel ([B, n_q_tiles, n_k_tiles] bools, small)."""
    n_q = qt.lo.shape[1]
    j = jnp.arange(n_k_tiles, dtype=jnp.int32)[None, None, :]
    visits = (qt.lo[..., None] <= j) & (j < qt.hi[..., None])
    full = (qt.f0[..., None] <= j) & (j < qt.f1[..., None])

    def first_last(m):  # [B, n_q, n_k] -> first, last+1 along n_q (0, 0 where none)
        some = m.any(axis=1)
        first = jnp.argmax(m, axis=1)
        last = n_q - jnp.argmax(m[:, ::-1], axis=1)
        return jnp.where(some, first, 0), jnp.where(some, last, 0), some

    i_lo, i_hi, _ = first_last(visits)
    g0, g1, some = first_last(full)
    contiguous = some & (full.sum(axis=1) == g1 - g0)
    g0 = jnp.where(contiguous, g0, i_lo)
    g1 = jnp.where(contiguous, g1, i_lo)
    return ContextTiles(*(x.astype(jnp.int32) for x in (i_lo, g0, g1, i_hi)))


def computed_fraction(qt: QueryTiles, *, block_q, block_k, num_queries, num_keys) -> jax.Array:
    """Fraction of the dense ``[num_queries, num_keys]`` score matrix the forward computes."""
    tiles = jnp.sum(qt.hi - qt.lo, axis=1)
    return tiles * (block_q * block_k) / (num_queries * num_keys)
