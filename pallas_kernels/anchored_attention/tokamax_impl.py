"""The context part through tokamax's attention op: its Hopper (Mosaic GPU, sm90) forward, our backward.

A slot of block j sees the context entries ``[doc_first(d_j), a_j)`` (mask.py), one key range per
query, which tokamax expresses as ``Mask(k_start, k_end)``. Its op returns the softmax residuals
(row max ``m``, denominator ``l``) with ``return_residuals=True``, so ``lse = m + log l`` is there
for the log-sum-exp merge with the in-block part.

The backward is ours (the Pallas dq and dk/dv kernels, or the chunked XLA one): tokamax's VJP
takes the cotangent of the output only and drops that of the residuals (``ops/op.py``: ``dout =
dout[0] if return_residuals``), while the merge differentiates through ``lse``; its gradient
would be silently wrong. Our kernels take ``(o, lse, do, dlse)``.

Preconditions: each document is one contiguous run of its row (the packed training rows and the
inference cache both are); no sliding window (its range depends on positions: ``ValueError``).

``implementation``: ``mosaic`` (``mosaic_gpu``, sm90/sm100 only), ``triton`` or ``xla`` (tokamax's
dense op: runs on CPU, and is how the tests check this module's masks, residuals and merge).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.anchored_attention.common import MASKED
from pallas_kernels.anchored_attention.tile_tables import per_anchor_ranges

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
BACKWARDS = ("pallas", "xla")


def available() -> str | None:
    """None if tokamax imports, else why not."""
    try:
        import tokamax  # noqa: F401
        from tokamax._src.ops.attention import api, base  # noqa: F401
    except ImportError as e:
        return f"tokamax does not import here ({e})"
    return None


def _op(implementation: str):
    from absl import flags
    from tokamax._src.ops.attention import api

    # tokamax reads its options as absl flags and, unless flags were parsed, parses sys.argv
    # itself, which fails on any other program's arguments (pytest's, our CLI's): take defaults.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])

    name = {"mosaic": "mosaic_gpu"}.get(implementation, implementation)
    if name not in api.IMPLEMENTATIONS:
        raise ValueError(
            f"tokamax has no attention implementation {name!r} here: {sorted(api.IMPLEMENTATIONS)}"
        )
    return api.IMPLEMENTATIONS[name]


def key_ranges(ctx_segment_ids, anchors, anchor_segment_ids, slots: int):
    """Per query ``[B, A*S]`` int32: the key range ``[k_start, k_end)`` it sees, empty (0, 0) where
    it sees nothing."""
    lo, _, hi = per_anchor_ranges(ctx_segment_ids, anchors, anchor_segment_ids)
    sees = lo < hi
    start = jnp.where(sees, lo, 0).astype(jnp.int32)
    end = jnp.where(sees, hi, 0).astype(jnp.int32)
    return jnp.repeat(start, slots, axis=1), jnp.repeat(end, slots, axis=1)


def tokamax_forward(q_rows, k, v, k_start, k_end, *, scale, implementation):
    """q [B,Q,N,H], k/v [B,T,K,H], ranges [B,Q] -> (out f32 [B,Q,N,H], lse f32 [B,Q,N])."""
    from tokamax._src.ops.attention import base

    mask = base.Mask(k_start=k_start[:, None, :], k_end=k_end[:, None, :])
    out, (m, denom) = _op(implementation)(q_rows, k, v, mask=mask, logits_scale=scale, return_residuals=True)
    empty = (k_end <= k_start)[:, :, None]  # [B, Q, 1]: tokamax returns a mean of all keys there
    lse = jnp.swapaxes(m.astype(jnp.float32) + jnp.log(denom.astype(jnp.float32)), 1, 2)
    out = jnp.where(empty[..., None], 0.0, out.astype(jnp.float32))
    return out, jnp.where(empty, MASKED, lse)


def context_attention_tokamax(
    q,
    k,
    v,
    ctx_segment_ids,
    ctx_positions,
    anchors,
    anchor_segment_ids,
    slot_positions,
    *,
    window,
    scale,
    implementation: str = "mosaic",
    backward: str = "pallas",
    interpret: bool = False,
    tiles=None,
    chunk: int = 16,
):
    """q [B,A,S,N,H], k/v [B,T,K,H] -> (out f32 [B,A,S,N,H], lse f32 [B,A,S,N]), differentiable."""
    if window is not None:
        raise ValueError(
            "impl='tokamax' does not take a sliding window (its key range depends on positions); "
            "use 'pallas' or 'xla' for sliding layers"
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown tokamax implementation {implementation!r}; expected {IMPLEMENTATIONS}")
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r} for impl='tokamax'; expected {BACKWARDS}")
    mask = (ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions)
    options = (implementation, backward, interpret, tiles, chunk, float(scale))
    return _attend(options, q, k, v, mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(options, q, k, v, mask):
    return _forward(options, q, k, v, mask)


def _forward(options, q, k, v, mask):
    implementation, _, _, _, _, scale = options
    B, A, S, N, H = q.shape
    k_start, k_end = key_ranges(mask[0], mask[2], mask[3], S)
    o, lse = tokamax_forward(
        q.reshape(B, A * S, N, H), k, v, k_start, k_end, scale=scale, implementation=implementation
    )
    return o.reshape(B, A, S, N, H), lse.reshape(B, A, S, N)


def _attend_fwd(options, q, k, v, mask):
    o, lse = _forward(options, q, k, v, mask)
    return (o, lse), (q, k, v, mask, o, lse)


def _attend_bwd(options, res, cot):
    _, backward, interpret, tiles, chunk, scale = options
    q, k, v, mask, o, lse = res
    do, dlse = cot
    if backward == "xla":
        from pallas_kernels.anchored_attention.xla import context_attention_xla

        _, vjp = jax.vjp(
            lambda q, k, v: context_attention_xla(q, k, v, *mask, window=None, scale=scale, chunk=chunk),
            q,
            k,
            v,
        )
        return (*vjp((do, dlse)), None)
    from pallas_kernels.anchored_attention import pallas_triton as pt

    B, A, S, N, H = q.shape
    st, q_rows, k_p, v_p, meta = pt.kernel_inputs(
        q, k, v, mask, window=None, scale=scale, interpret=interpret, tiles=tiles
    )
    Qp, T = q_rows.shape[1], k.shape[1]

    def rows(x):  # [B,A,S,N,...] -> [B,Qp,N,...]
        return pt._pad_axis(x.reshape(B, A * S, *x.shape[3:]), 1, Qp)

    def by_head(x):  # [B,A,S,N] -> [B,N,Qp]
        return jnp.swapaxes(rows(x), 1, 2)

    dq, dk, dv = pt._backward(st, q_rows, k_p, v_p, meta, rows(o), by_head(lse), rows(do), by_head(dlse))
    return dq[:, : A * S].reshape(q.shape), dk[:, :T], dv[:, :T], None


_attend.defvjp(_attend_fwd, _attend_bwd)


def packed_causal_attention_tokamax(q, k, v, segment_ids, *, scale, implementation="mosaic"):
    """The target's training attention (causal inside packed documents) through tokamax:
    q [B,T,N,H], k/v [B,T,K,H], segment_ids [B,T] (documents contiguous) -> [B,T,N,H]. Query t
    sees keys ``[doc_first(t), t]``: ``Mask(k_start, is_causal=True)``. Used by the GPU check to
    measure the library kernel against ``dflash_jax.target.attention.attend``."""
    from tokamax._src.ops.attention import base

    T = segment_ids.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    starts = (idx == 0) | (segment_ids != jnp.roll(segment_ids, 1, axis=1))
    k_start = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    mask = base.Mask(k_start=k_start[:, None, :], is_causal=True)
    return _op(implementation)(q, k, v, mask=mask, logits_scale=scale)
