"""Pieces every implementation of the context attention shares: head grouping and the masked
softmax with its convention for rows that see nothing.

Shapes: B batch, A anchors, S slots, T context, N query heads = K kv heads x G, H head_dim.

Empty rows (a block at a document start, an invalid anchor): ``out = 0`` and ``lse = MASKED``, a
finite "minus infinity", so that merging with the in-block part gives this part a weight of
exactly 0 and values and gradients stay finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30


def group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[..., N, H] -> [..., K, G, H]; head n = k * G + g, as HF's repeat_kv lays them out."""
    *lead, N, H = q.shape
    return q.reshape(*lead, num_kv_heads, N // num_kv_heads, H)


def ungroup(x: jax.Array, trailing: int) -> jax.Array:
    """Merge the K, G axes back into N: ``trailing`` = number of axes after G (1 for o, 0 for lse)."""
    shape = x.shape
    k_axis = len(shape) - 2 - trailing
    return x.reshape(*shape[:k_axis], shape[k_axis] * shape[k_axis + 1], *shape[k_axis + 2 :])


def masked_softmax(s: jax.Array, vis: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax pieces over the last axis: probabilities (rows of zeros where nothing is visible)
    and the row log-sum-exp (``MASKED`` where nothing is visible)."""
    s = jnp.where(vis, s, MASKED)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    empty = denom == 0
    safe = jnp.where(empty, 1.0, denom)
    lse = jnp.where(empty, MASKED, m + jnp.log(safe))
    return p / safe, lse[..., 0]


def check_shapes(q, k, v, ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions):
    """Raise a ValueError naming the argument whose shape does not fit ``q [B, A, S, N, H]``."""
    if q.ndim != 5:
        raise ValueError(f"q must be [B, A, S, N, H], got shape {tuple(q.shape)}")
    B, A, S, N, H = q.shape
    if k.ndim != 4:
        raise ValueError(f"k must be [B, T, K, H], got shape {tuple(k.shape)}")
    T, K = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"query heads {N} not a multiple of kv heads {K}")
    for name, x, want in (
        ("k", k, (B, T, K, H)),
        ("v", v, (B, T, K, H)),
        ("ctx_segment_ids", ctx_segment_ids, (B, T)),
        ("ctx_positions", ctx_positions, (B, T)),
        ("anchors", anchors, (B, A)),
        ("anchor_segment_ids", anchor_segment_ids, (B, A)),
        ("slot_positions", slot_positions, (B, A, S)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want}")
