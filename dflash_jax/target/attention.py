"""Target self-attention without a T x S score tensor in memory.

The mask is described by three small arrays instead of a dense ``[B, T, S]`` boolean::

    q_index   [B, T]  the key slot each query sits at (its causal bound)
    q_segment [B, T]  the packed document of each query
    kv_segment[B, S]  the packed document of each key

Query t of row b sees key s iff ``s <= q_index[b, t]`` and ``kv_segment[b, s] == q_segment[b, t]``.
Two packed documents, ``segment = [1 1 1 2 2]``, ``q_index = [0 1 2 3 4]``::

    q\\k  0 1 2 3 4
     0   x . . . .
     1   x x . . .
     2   x x x . .
     3   . . . x .
     4   . . . x x

A decode step with a KV cache is the same picture shifted: ``q_index = lengths[b] + t`` and every
key in one segment, so the stale tail of the cache (``s > q_index``) is never seen.

gpt-oss adds two things: a sliding ``window`` (a query also needs ``s > q_index - window``; 0 =
unlimited; a traced scalar, so sliding and full layers share one scanned layer body) and
``sinks``, one learned logit per query head that joins the softmax's denominator and nothing else
(the online softmax starts from it instead of from -inf).

``attend_xla`` is a flash-style formulation: query tiles (``lax.map``) times KV tiles (a loop that
stops at the last tile the causal bound can reach and skips tiles whose segments cannot match),
with an online softmax in fp32. Peak memory is O(tile_q x tile_kv) scores per head instead of
O(T x S). ``attend_reference`` is the dense formulation, kept as the test reference.

``attend`` dispatches by ``impl`` (the model's ``target.attention_impl``): ``xla`` is
``attend_xla``; ``pallas`` is the GPU kernel of ``pallas_kernels/segment_attention`` (no sinks, no
window); ``auto`` takes the kernel only where a GPU check validated it for this device kind and
shape (``pallas_kernels/segment_attention/validated.json``, empty today: ``auto`` is ``xla``
everywhere) and only for self-attention (not a KV-cache step). On a mesh the kernel runs under
``shard_map`` on each device's rows and heads. Both are forward only (``attend_xla``'s
loops have dynamic bounds, which reverse mode cannot differentiate): the target is frozen and the
trainer stops gradients at its outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.sharding import _current_mesh
from pallas_kernels.padding import pad_axis1 as _pad_axis1

BATCH_MESH_AXES = ("data", "fsdp")  # what ``batch`` maps to (sharding.DEFAULT_RULES)

NEG_INF = -1e30
DEFAULT_Q_TILE = 512
DEFAULT_KV_TILE = 512


def self_attention_mask(batch: int, length: int, segment_ids=None):
    """(q_index, q_segment, kv_segment) for causal self-attention over packed documents."""
    idx = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (batch, length))
    seg = jnp.ones((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    return idx, seg, seg


def cache_attention_mask(lengths, new_tokens: int, capacity: int):
    """(q_index, q_segment, kv_segment) for T new tokens appended at each row's cache length."""
    batch = lengths.shape[0]
    q_index = lengths[:, None].astype(jnp.int32) + jnp.arange(new_tokens, dtype=jnp.int32)[None]
    return (
        q_index,
        jnp.zeros((batch, new_tokens), jnp.int32),
        jnp.zeros((batch, capacity), jnp.int32),
    )


def _in_window(k_idx, q_index, window):
    """k_idx [...,S] vs q_index [...,T,1]: inside the sliding window (always, for window <= 0)."""
    if window is None:
        return True
    return (window <= 0) | (k_idx > q_index - window)


def attend_reference(q, k, v, q_index, q_segment, kv_segment, scale, *, sinks=None, window=None):
    """Dense attention: q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H]. Materialises [B,K,G,T,S] fp32."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    k_idx = jnp.arange(S)[None, None, :]
    mask = (
        (k_idx <= q_index[:, :, None])
        & (q_segment[:, :, None] == kv_segment[:, None, :])
        & _in_window(k_idx, q_index[:, :, None], window)
    )
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1), (B, K, N // K, T, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :S].astype(v.dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # A query that sees no key at all (never produced by the masks above) would get a uniform mix.
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, H)


def attend(q, k, v, q_index, q_segment, kv_segment, scale, *, sinks=None, window=None, impl: str = "xla"):
    """``attend_xla``'s contract, run by ``impl``: ``xla``, ``pallas`` or ``auto`` (module docstring)."""
    if impl != "xla":
        from pallas_kernels.segment_attention import api as kernel

        impl, entry = kernel.resolve_impl(
            impl, head_dim=q.shape[-1], groups=q.shape[2] // k.shape[2], dtype=q.dtype, query_len=q.shape[1],
            key_len=k.shape[1], sinks=sinks is not None, window=window is not None,
        )  # fmt: skip
    if impl == "xla":
        return attend_xla(q, k, v, q_index, q_segment, kv_segment, scale, sinks=sinks, window=window)
    if sinks is not None or window is not None:
        raise ValueError(
            "target attention_impl=pallas: the segment attention kernel has no attention sinks or sliding "
            "window (gpt-oss); use target.attention_impl=xla or auto for this target"
        )
    from pallas_kernels.segment_attention.pallas_triton import TileConfig

    tiles = TileConfig(**entry["tiles"]) if entry is not None and entry.get("tiles") else None

    def run(q, k, v, q_index, q_segment, kv_segment):
        return kernel.segment_attention(q, k, v, q_index, q_segment, kv_segment, scale=scale, tiles=tiles)

    return _per_device(run, q, k, v, q_index, q_segment, kv_segment)


def _axes_dividing(mesh, names, n: int) -> tuple[str, ...]:
    """The mesh axes of ``names`` with size > 1, if their product divides n, else ()."""
    axes = tuple(a for a in names if mesh.shape.get(a, 1) > 1)
    return axes if axes and n % int(np.prod([mesh.shape[a] for a in axes])) == 0 else ()


def _per_device(run, q, k, v, q_index, q_segment, kv_segment):
    """``run`` (the kernel) on each device's own rows and heads under the current mesh: a Pallas
    call outside ``shard_map`` would be given every device's operands. Rows split over the batch
    axes (data, fsdp) and heads over tensor where they divide (kv heads too: query head n reads kv
    head n // G, so contiguous blocks of both stay together); other axes compute replicated."""
    mesh = _current_mesh()
    if mesh is None or mesh.size == 1:
        return run(q, k, v, q_index, q_segment, kv_segment)
    from jax.sharding import PartitionSpec as P

    rows = _axes_dividing(mesh, BATCH_MESH_AXES, q.shape[0]) or None
    heads = (
        _axes_dividing(mesh, ("tensor",), q.shape[2]) and _axes_dividing(mesh, ("tensor",), k.shape[2])
    ) or None
    per_head, per_token = P(rows, None, heads, None), P(rows, None)
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(per_head, per_head, per_head, per_token, per_token, per_token),
        out_specs=per_head,
        check_vma=False,
    )(q, k, v, q_index, q_segment, kv_segment)


def attend_xla(
    q,
    k,
    v,
    q_index,
    q_segment,
    kv_segment,
    scale,
    *,
    q_tile: int | None = None,
    kv_tile: int | None = None,
    sinks=None,
    window=None,
):
    """Tiled attention with an online softmax: same contract and values as ``attend_reference``.

    q [B,T,N,H], k/v [B,S,K,H] (N a multiple of K), masks as in the module docstring; sinks [N]
    (optional), window a scalar (optional, 0 = unlimited).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    tq = min(T, q_tile or DEFAULT_Q_TILE)  # module defaults read at call time (tests shrink them)
    tk = min(S, kv_tile or DEFAULT_KV_TILE)
    # Padded queries sit at index -1 (see nothing, dropped at the end); padded keys carry a
    # segment no query has and an index past every causal bound.
    qg = _pad_axis1(q.reshape(B, T, K, G, H), tq, 0)
    q_index_p = _pad_axis1(q_index.astype(jnp.int32), tq, -1)
    q_seg_p = _pad_axis1(q_segment.astype(jnp.int32), tq, jnp.iinfo(jnp.int32).min)
    k_p = _pad_axis1(k, tk, 0)
    v_p = _pad_axis1(v, tk, 0)
    kv_seg_p = _pad_axis1(kv_segment.astype(jnp.int32), tk, jnp.iinfo(jnp.int32).max)
    nq, nk = qg.shape[1] // tq, k_p.shape[1] // tk

    # Per KV tile: the range of segment ids it holds (a tile is skipped when no query's segment
    # can fall inside it).
    kv_seg_tiles = kv_seg_p.reshape(B, nk, tk)
    kv_seg_lo, kv_seg_hi = kv_seg_tiles.min(axis=(0, 2)), kv_seg_tiles.max(axis=(0, 2))

    def one_query_tile(xs):
        q_t, qi_t, qs_t = xs  # [B,tq,K,G,H], [B,tq], [B,tq]
        last = jnp.max(qi_t)
        n_needed = jnp.clip(last // tk + 1, 0, nk)  # tiles past the causal bound are never read
        first = 0
        if window is not None:  # tiles wholly before every query's window are never read
            lowest = jnp.min(jnp.where(qi_t >= 0, qi_t, jnp.iinfo(jnp.int32).max)) - window + 1
            first = jnp.where(window > 0, jnp.clip(lowest // tk, 0, nk), 0)
        q_seg_lo, q_seg_hi = jnp.min(qs_t), jnp.max(qs_t)

        def kv_step(j, carry):
            def compute(carry):
                m, row_sum, acc = carry
                k_t = jax.lax.dynamic_slice_in_dim(k_p, j * tk, tk, axis=1)
                v_t = jax.lax.dynamic_slice_in_dim(v_p, j * tk, tk, axis=1)
                ks_t = jax.lax.dynamic_slice_in_dim(kv_seg_p, j * tk, tk, axis=1)
                k_idx = j * tk + jnp.arange(tk, dtype=jnp.int32)
                visible = (
                    (k_idx[None, None, :] <= qi_t[:, :, None])
                    & (qs_t[:, :, None] == ks_t[:, None, :])
                    & _in_window(k_idx[None, None, :], qi_t[:, :, None], window)
                )  # [B,tq,tk]
                s = jnp.einsum("BTKGH,BSKH->BKGTS", q_t, k_t, preferred_element_type=jnp.float32)
                s = jnp.where(visible[:, None, None], s * scale, NEG_INF)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.where(visible[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                l_new = row_sum * corr + p.sum(axis=-1)
                pv = jnp.einsum(
                    "BKGTS,BSKH->BKGTH", p.astype(v_t.dtype), v_t, preferred_element_type=jnp.float32
                )
                return m_new, l_new, acc * corr[..., None] + pv

            overlaps = (kv_seg_hi[j] >= q_seg_lo) & (kv_seg_lo[j] <= q_seg_hi)
            return jax.lax.cond(overlaps, compute, lambda c: c, carry)

        if sinks is None:
            m0, l0 = jnp.full((B, K, G, tq), NEG_INF, jnp.float32), jnp.zeros((B, K, G, tq), jnp.float32)
        else:  # the sink is one more score with a zero value: exp(sink - m0) = 1 in the sum
            m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, G, 1), (B, K, G, tq))
            l0 = jnp.ones((B, K, G, tq), jnp.float32)
        init = (m0, l0, jnp.zeros((B, K, G, tq, H), jnp.float32))
        _, row_sum, acc = jax.lax.fori_loop(first, n_needed, kv_step, init)
        out = acc / jnp.where(row_sum == 0, 1.0, row_sum)[..., None]  # a query that sees nothing -> 0
        return jnp.einsum("BKGTH->BTKGH", out).astype(q.dtype)

    tiles = (
        jnp.moveaxis(qg.reshape(B, nq, tq, K, G, H), 1, 0),
        jnp.moveaxis(q_index_p.reshape(B, nq, tq), 1, 0),
        jnp.moveaxis(q_seg_p.reshape(B, nq, tq), 1, 0),
    )
    out = jax.lax.map(one_query_tile, tiles)  # [nq,B,tq,K,G,H]
    out = jnp.moveaxis(out, 0, 1).reshape(B, nq * tq, N, H)
    return out[:, :T]
