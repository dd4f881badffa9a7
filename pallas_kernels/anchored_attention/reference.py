"""Dense reference of the context part: every slot of every block against all T context keys.

Obviously correct and memory ``[B, A*S, N, T]``: for tests and small debugging runs only.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.anchored_attention.common import group, masked_softmax, ungroup
from pallas_kernels.anchored_attention.mask import context_visible


def context_attention_reference(
    q, k, v, ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions, *, window, scale
):
    """q [B,A,S,N,H], k/v [B,T,K,H] -> (out f32 [B,A,S,N,H], lse f32 [B,A,S,N])."""
    K = k.shape[2]
    vis = context_visible(ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions, window)
    s = jnp.einsum("BASKGH,BTKH->BASKGT", group(q, K), k, preferred_element_type=jnp.float32) * scale
    p, lse = masked_softmax(s, vis[:, :, :, None, None, :])
    o = jnp.einsum("BASKGT,BTKH->BASKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return ungroup(o, 1), ungroup(lse, 0)
