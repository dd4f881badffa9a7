"""Which key tiles each query tile visits, computed in plain jax from the small mask arrays.

Query t sees key s iff ``s <= q_index[t]`` and ``kv_segment[s] == q_segment[t]``. Per tile of
``block_q`` queries and ``block_k`` keys the tables keep two cheap summaries: the largest causal
bound of the query tile (key tiles past it are never read: causal block skipping) and each tile's
range of segment ids (a key tile whose range misses the query tile's is never read: segment
skipping). In units of key tiles, per query tile::

    lo <= f0 <= f1 <= hi          visit [lo, hi); tiles in [f0, f1) need no mask

Example: T=S=12, block 4, documents ``[1 1 1 1 1 1 1 1 2 2 2 2]``::

    key tile         0      1      2
    keys           0-3    4-7    8-11
    query tile 0:  diag   .      .        lo=0 hi=1, no mask-free tile (f0=f1=hi)
    query tile 1:  full   diag   .        lo=0 f0=0 f1=1 hi=2
    query tile 2:  skip   skip   diag     lo=2 hi=3 (tiles 0, 1 hold only document 1)

A mask-free tile holds one segment, the query tile's only one, and lies wholly at or below the
diagonal of every query in the tile. The tables are a covering for any input (unsorted or repeated
segment ids, a KV cache's shifted ``q_index``): every visible pair lies in a visited tile; packed
rows (non-decreasing segments) make them tight. Inside ``[lo, f0)`` and ``[f1, hi)`` the kernel
still skips a tile whose segment range misses the query tile's (``key_segments``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Padding: a padded query (index -1) holds a segment no key has; a padded key one no query has.
PAD_QUERY_SEGMENT = jnp.iinfo(jnp.int32).min
PAD_KEY_SEGMENT = jnp.iinfo(jnp.int32).max


class Tables(NamedTuple):
    query: tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # lo, f0, f1, hi: [B, n_q_tiles] int32
    key_segments: tuple[jax.Array, jax.Array]  # each key tile's lowest, highest segment: [B, n_k_tiles]


def tile_tables(q_index, q_segment, kv_segment, *, block_q: int, block_k: int) -> Tables:
    """q_index, q_segment [B, Tp] and kv_segment [B, Sp], already padded to whole tiles."""
    B, Tp = q_index.shape
    Sp = kv_segment.shape[1]
    nq, nk = Tp // block_q, Sp // block_k
    qi = q_index.reshape(B, nq, block_q)
    qs = q_segment.reshape(B, nq, block_q)
    ks = kv_segment.reshape(B, nk, block_k)
    q_lo, q_hi = qs.min(axis=2), qs.max(axis=2)  # [B, nq]
    k_lo, k_hi = ks.min(axis=2), ks.max(axis=2)  # [B, nk]
    tile = jnp.arange(nk, dtype=jnp.int32)
    # causal: key tile j is reachable by some query of the tile iff j * block_k <= max q_index
    reach = tile[None, None, :] * block_k <= qi.max(axis=2)[:, :, None]  # [B, nq, nk]
    overlaps = (k_hi[:, None, :] >= q_lo[:, :, None]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    visit = reach & overlaps
    # mask-free: one segment on both sides, equal, and the tile's last key <= every query's bound
    below = (tile[None, None, :] + 1) * block_k - 1 <= qi.min(axis=2)[:, :, None]
    one_segment = ((q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :]) & (
        k_lo[:, None, :] == q_lo[:, :, None]
    )
    full = visit & below & one_segment

    big = jnp.int32(nk)
    lo = jnp.min(jnp.where(visit, tile, big), axis=2)
    hi = jnp.max(jnp.where(visit, tile + 1, 0), axis=2)
    lo = jnp.minimum(lo, hi)  # nothing to visit: lo == hi == 0
    f0 = jnp.min(jnp.where(full, tile, big), axis=2)
    # the run of mask-free tiles starting at f0: up to the first tile at or after f0 that is not
    not_full_after = jnp.where(~full & (tile[None, None, :] >= f0[:, :, None]), tile, big)
    f1 = jnp.minimum(jnp.min(not_full_after, axis=2), hi)
    none = f0 >= hi
    f0 = jnp.where(none, hi, f0)
    f1 = jnp.where(none, hi, f1)
    i32 = jnp.int32
    return Tables(
        (lo.astype(i32), f0.astype(i32), f1.astype(i32), hi.astype(i32)), (k_lo.astype(i32), k_hi.astype(i32))
    )
