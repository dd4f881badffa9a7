"""Dense reference: every query against every key, the whole ``[B, K, G, T, S]`` score tensor in
memory. Obviously correct; for tests and tiny debugging runs only."""

from __future__ import annotations

import jax.numpy as jnp

MASKED = -1e30  # a finite "minus infinity": rows that see nothing stay finite


def segment_attention_reference(q, k, v, q_index, q_segment, kv_segment, *, scale):
    """q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H] in q's dtype; a query that sees no key gets zeros."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    visible = (jnp.arange(S)[None, None, :] <= q_index[:, :, None]) & (
        q_segment[:, :, None] == kv_segment[:, None, :]
    )  # [B,T,S]
    qg = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    vis = visible[:, None, None]
    s = jnp.where(vis, s, MASKED)
    p = jnp.where(vis, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, H).astype(q.dtype)
