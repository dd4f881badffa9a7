"""The anchored block mask of DFlash attention, as a small object (never a dense [T, T] array).

Queries are the ``S`` slots of ``A`` blocks; keys are the ``T`` context entries plus each block's
own slots. Block j (anchor index ``a_j``, document ``d_j``) sees (invariant 3):

* context entry p iff ``segment[p] == d_j != 0`` and ``p < a_j`` (strictly before its anchor),
  and, in a sliding layer, ``pos(slot) - pos[p] < window``;
* its own slots (all of them; slot k only slots <= k in a causal layer; the window applies too);
* nothing of any other block.

Example: T=8, two documents ``seg = 1 1 1 1 2 2 2 2``, anchors ``(2, 6)``, S=2, bidirectional::

                     context p       own block
                  0 1 2 3 4 5 6 7     s0 s1
    block 0  s0   x x . . . . . .     x  x
             s1   x x . . . . . .     x  x
    block 1  s0   . . . . x x . .     x  x
             s1   . . . . x x . .     x  x

An anchor at a document start (or an invalid anchor, ``anchor_segment_ids == 0``) sees no context
but always its own block, so no softmax row of the whole attention is ever empty (the context part
alone may be: see ``api.context_attention``).

Positions (invariant 4): context key p uses ``positions[p]``; slot k of block j uses
``positions[a_j] + k`` (``slot_positions``).

Only jax: a NamedTuple is a pytree, so the mask passes through ``jit``/``grad`` like any array tuple.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class AnchoredMask(NamedTuple):
    """Everything a kernel needs to decide visibility; shapes ``B`` batch, ``T`` context, ``A``
    anchors, ``S`` slots per block.

    ctx_segment_ids   [B, T] int32   document id of each context entry (0: padding, never seen)
    ctx_positions     [B, T] int32   RoPE position of each context entry (used by sliding windows)
    anchors           [B, A] int32   exclusive upper bound of the context a block sees (its index)
    anchor_segment_ids [B, A] int32  document of each block; 0 = sees no context (invalid anchor)
    slot_positions    [B, A, S] int32  RoPE position of every slot
    """

    ctx_segment_ids: jax.Array
    ctx_positions: jax.Array
    anchors: jax.Array
    anchor_segment_ids: jax.Array
    slot_positions: jax.Array

    @property
    def block_size(self) -> int:
        return self.slot_positions.shape[-1]

    @classmethod
    def for_packed_rows(cls, segment_ids, positions, anchors, anchor_valid, block_size: int) -> AnchoredMask:
        """Training layout: anchors index the packed row; slot k sits at ``positions[anchor] + k``."""
        T = segment_ids.shape[1]
        idx = jnp.clip(anchors, 0, T - 1)
        anchor_seg = jnp.take_along_axis(segment_ids, idx, axis=1)
        anchor_pos = jnp.take_along_axis(positions, idx, axis=1)
        return cls(
            ctx_segment_ids=segment_ids.astype(jnp.int32),
            ctx_positions=positions.astype(jnp.int32),
            anchors=anchors.astype(jnp.int32),
            anchor_segment_ids=jnp.where(anchor_valid, anchor_seg, 0).astype(jnp.int32),
            slot_positions=(anchor_pos[..., None] + jnp.arange(block_size, dtype=jnp.int32)).astype(
                jnp.int32
            ),
        )

    @classmethod
    def for_cache(cls, cache_positions, cache_lengths, block_positions) -> AnchoredMask:
        """Inference layout: one block per row after the first ``cache_lengths[b]`` cache entries."""
        B, C = cache_positions.shape
        valid = jnp.arange(C, dtype=jnp.int32)[None, :] < cache_lengths[:, None]
        return cls(
            ctx_segment_ids=valid.astype(jnp.int32),
            ctx_positions=cache_positions.astype(jnp.int32),
            anchors=cache_lengths[:, None].astype(jnp.int32),
            anchor_segment_ids=jnp.ones((B, 1), jnp.int32),
            slot_positions=block_positions[:, None, :].astype(jnp.int32),
        )

    def context_visible(self, window: int | None = None) -> jax.Array:
        """[B, A, S, T] bool: which context entries each slot sees (materialise per chunk only)."""
        return context_visible(*self, window)

    def block_visible(self, causal: bool, window: int | None = None) -> jax.Array:
        """[B, A, S, S] bool: which slots of its own block each slot sees."""
        return block_visible(self.slot_positions, causal, window)


def context_visible(ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions, window):
    """Functional form of ``AnchoredMask.context_visible`` (takes a chunk of anchors as well)."""
    T = ctx_segment_ids.shape[1]
    p = jnp.arange(T, dtype=jnp.int32)
    seg = anchor_segment_ids[:, :, None, None]
    vis = (ctx_segment_ids[:, None, None, :] == seg) & (seg != 0)
    vis = vis & (p[None, None, None, :] < anchors[:, :, None, None])
    if window is not None:
        vis = vis & (slot_positions[..., None] - ctx_positions[:, None, None, :] < window)
    return jnp.broadcast_to(vis, (*slot_positions.shape, T))


def block_visible(slot_positions, causal: bool, window: int | None):
    """[..., S, S] bool: slot (query) k sees slot (key) k' of the same block."""
    dist = slot_positions[..., :, None] - slot_positions[..., None, :]  # query - key
    vis = jnp.ones(dist.shape, bool)
    if causal:
        vis = vis & (dist >= 0)
    if window is not None:
        vis = vis & (dist < window)
        if not causal:
            vis = vis & (-dist < window)
    return vis
