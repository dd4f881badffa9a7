"""The context part in plain XLA, ``chunk`` anchors at a time.

``lax.map`` + ``jax.checkpoint`` over chunks of anchors: the forward and the backward hold one
chunk's ``[Ac*S, T]`` scores at a time, whatever the number of anchors. XLA needs static shapes, so
every chunk still scans all T context entries; the Pallas kernel skips the fully masked tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.anchored_attention.reference import context_attention_reference


def context_attention_xla(
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
    chunk: int = 16,
):
    """q [B,A,S,N,H], k/v [B,T,K,H] -> (out f32 [B,A,S,N,H], lse f32 [B,A,S,N])."""
    B, A = q.shape[:2]
    per_anchor = (q, anchors, anchor_segment_ids, slot_positions)

    def run(q_c, anchors_c, seg_c, pos_c):  # one chunk: the dense computation on Ac anchors
        return context_attention_reference(
            q_c, k, v, ctx_segment_ids, ctx_positions, anchors_c, seg_c, pos_c, window=window, scale=scale
        )

    if A <= chunk:
        return run(*per_anchor)
    n = -(-A // chunk)
    pad = n * chunk - A

    def split(x):  # [B, A, ...] -> [n, B, chunk, ...]; padded anchors (segment 0) see no context
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def merge(x):  # [n, B, chunk, ...] -> [B, A, ...]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(B, n * chunk, *x.shape[3:])[:, :A]

    o, lse = jax.lax.map(lambda xs: jax.checkpoint(run)(*xs), tuple(split(x) for x in per_anchor))
    return merge(o), merge(lse)
