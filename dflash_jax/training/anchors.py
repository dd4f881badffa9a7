"""Anchor sampling and per-slot training masks: where each block starts, which slots train
(invariant 5).

An anchor is any position a with ``loss_mask[a]`` and ``loss_mask[a+1]`` in the same document:
at inference every reply ends inside some block, so blocks may start anywhere in a reply, even
in its last token but one. Slot k (1..B-1) of the block at a predicts token a+k and is trained
iff every token a+1..a+k is in the loss mask of a's document (a running product along the
slots): a block is cut at the end of its reply and never reaches into the next turn or document,
even if a later reply of the same document is back inside the loss mask. Slots past the end of
the row are untrained, never wrapped or clipped onto real positions.

Up to ``max_anchors`` anchors are drawn uniformly without replacement per row and returned
sorted; rows with fewer candidates get padded anchors (``valid`` False) after the real ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def anchor_candidates(loss_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[R,T] bool: positions that may start a block (their slot 1 is trained)."""
    in_mask = loss_mask.astype(bool) & (segment_ids != 0)
    nxt_in_mask = jnp.pad(in_mask[:, 1:], ((0, 0), (0, 1)))  # position T has no token: False
    nxt_same_doc = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (0, 1)))
    return in_mask & nxt_in_mask & nxt_same_doc


def sample_anchors(key, loss_mask, segment_ids, *, max_anchors: int):
    """-> (anchors [R,A] int32 ascending, valid [R,A] bool). Padded anchors point at T-1."""
    R, T = segment_ids.shape
    cand = anchor_candidates(loss_mask, segment_ids)
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


def slot_targets(anchors, anchor_valid, loss_mask, segment_ids, block_size: int):
    """Which slots of each block train, and where their labels come from.

    anchors, anchor_valid [R,A]; loss_mask, segment_ids [R,T].
    Returns (label_pos [R,A,B-1] int32, trained [R,A,B-1] bool) for slots k = 1..B-1:
    ``label_pos`` = a+k-1, the position whose target logits label slot k (invariant 2), for
    trained slots; untrained slots point at the anchor itself (a real position of the same
    document, so a gather there is harmless and carries no weight).
    """
    R, T = loss_mask.shape
    k = jnp.arange(1, block_size, dtype=jnp.int32)
    predicted = anchors[..., None] + k  # [R,A,B-1] a+k, may run past the row
    inside = predicted < T
    safe = jnp.where(inside, predicted, 0).reshape(R, -1)
    in_mask = jnp.take_along_axis(loss_mask.astype(bool), safe, axis=1).reshape(predicted.shape)
    seg_at = jnp.take_along_axis(segment_ids, safe, axis=1).reshape(predicted.shape)
    anchor_seg = jnp.take_along_axis(segment_ids, jnp.clip(anchors, 0, T - 1), axis=1)
    ok = inside & in_mask & (seg_at == anchor_seg[..., None]) & (anchor_seg[..., None] != 0)
    # The running product: slot k trains only if every token a+1..a+k does.
    trained = anchor_valid[..., None] & (jnp.cumprod(ok.astype(jnp.int32), axis=-1) == 1)
    label_pos = jnp.where(trained, predicted - 1, anchors[..., None]).astype(jnp.int32)
    return label_pos, trained


# --------------------------------------------------------------------------- the greedy path
#
# Greedy speculative decoding needs slot k only once slots 1..k-1 were accepted, i.e. equal the
# target's own choices. A dataset's reply leaves that path wherever its token differs from the
# target's choice (~40 % of the demo's tokens), and a slot labelled after such a token learns what
# the target says after a token decoding never drafts from. ``train.greedy_slots`` keeps those
# slots out of the loss.


def greedy_slots(input_ids, label_pos, labels):
    """[R,A,B-1] bool: slot k is on the target's greedy path, i.e. every data token a+1..a+k-1
    equals the label (the target's choice) of the slot before it; slot 1 always is.
    ``input_ids`` [R,T]; ``label_pos`` [R,A,B-1] (a+k-1, ``slot_targets``); ``labels`` [R,A,B-1]
    target ids: the target's argmax over its whole vocabulary (under either loss)."""
    R, T = input_ids.shape
    nxt = jnp.minimum(label_pos + 1, T - 1).reshape(R, -1)
    data_tokens = jnp.take_along_axis(input_ids, nxt, axis=1).reshape(label_pos.shape)  # a+k
    agree = (data_tokens == labels).astype(jnp.int32)
    # slot k needs agreement at slots 1..k-1: an exclusive running product along the slots
    before = jnp.concatenate([jnp.ones_like(agree[..., :1]), jnp.cumprod(agree, axis=-1)[..., :-1]], axis=-1)
    return before == 1


# --------------------------------------------------------------------------- label counts (host)


def label_positions(loss_mask: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """[R, T] bool: positions p whose label (the target's argmax at p, the next token) a block can
    train, i.e. p+1 lies in the loss mask of p's document (anchors.slot_targets' label positions)."""
    loss_mask, segment_ids = np.asarray(loss_mask), np.asarray(segment_ids)
    out = np.zeros(loss_mask.shape, bool)
    nxt = (loss_mask[:, 1:] != 0) & (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] != 0)
    out[:, :-1] = nxt
    return out


def count_labels(labels, loss_mask, segment_ids, vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each target id is the label at a trainable position of these rows."""
    keep = label_positions(loss_mask, segment_ids)
    return np.bincount(np.asarray(labels)[keep].astype(np.int64), minlength=vocab_size)[:vocab_size]
