"""Anchor sampling: where each training block starts (invariant 5).

An anchor p is a position inside the loss mask whose block p..p+B-1 stays inside p's document.
Up to ``max_anchors`` are drawn uniformly without replacement per row and returned sorted; rows
with fewer candidates get padded anchors (``valid`` False) placed after the real ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def anchor_candidates(loss_mask: jax.Array, segment_ids: jax.Array, block_size: int) -> jax.Array:
    """[R,T] bool: positions that may start a block."""
    R, T = segment_ids.shape
    idx = jnp.arange(T)
    end = jnp.minimum(idx + block_size - 1, T - 1)
    same_doc = jnp.take_along_axis(segment_ids, jnp.broadcast_to(end, (R, T)), axis=1) == segment_ids
    room = (idx + block_size - 1 < T)[None] & same_doc
    return loss_mask.astype(bool) & room & (segment_ids != 0)


def sample_anchors(key, loss_mask, segment_ids, *, block_size: int, max_anchors: int):
    """-> (anchors [R,A] int32 ascending, valid [R,A] bool). Padded anchors point at T-1."""
    R, T = segment_ids.shape
    cand = anchor_candidates(loss_mask, segment_ids, block_size)
    scores = jnp.where(cand, jax.random.uniform(key, (R, T)), -1.0)
    k = min(max_anchors, T)
    top, idx = jax.lax.top_k(scores, k)
    valid = top >= 0
    order_key = jnp.where(valid, idx, T + idx)
    order = jnp.argsort(order_key, axis=1)
    anchors = jnp.take_along_axis(jnp.where(valid, idx, T - 1), order, axis=1).astype(jnp.int32)
    valid = jnp.take_along_axis(valid, order, axis=1)
    if k < max_anchors:
        pad = max_anchors - k
        anchors = jnp.concatenate([anchors, jnp.full((R, pad), T - 1, jnp.int32)], axis=1)
        valid = jnp.concatenate([valid, jnp.zeros((R, pad), bool)], axis=1)
    return anchors, valid


def block_positions(anchors: jax.Array, block_size: int, length: int) -> jax.Array:
    """[R,A,B] indices anchor+k, clipped into the row (padded anchors stay in range)."""
    return jnp.minimum(anchors[..., None] + jnp.arange(block_size), length - 1)
