"""The drafter's loss against the target's own output distribution (invariants 2, 5, 6).

Slot k (1..B-1) of the block anchored at p predicts token p+k; its label distribution is the
target's logits at position p+k-1, i.e. ``lm_head(final_norm(last layer))`` there. Slot 0 holds the
real token at p and carries no loss. The drafter's logits come from the function decoding uses
(its lm_head pass with ``logit_scale``/``logit_softcap``), passed in as ``draft_logits``.
Vocabularies are large (50k-250k), so logits exist only one chunk of slots at a time, never as
[slots, V] at once; each chunk's gradient w.r.t. the drafter's hidden state is taken in the
forward pass (``_fused_chunk``), so nothing is recomputed in the backward pass.

Slot weighting (``train.loss_weighting``):

* ``decay``: ``w_k = exp(-(k-1)/gamma)`` (the DFlash paper), loss = weighted mean;
* ``uniform``: ``w_k = 1``, loss = mean over trained slots;
* ``dpace`` (arXiv 2605.18810): ``q_k = exp(-CE_k)`` (no gradient), ``s_k = (1-alpha) q_k + alpha``
  (1 for untrained slots), ``P_k = prod_{i<=k} s_i``, ``w_k = sum_{m>=k, m trained} P_m``; loss =
  ``sum_k w_k L_k`` over trained slots divided by the number of trained slots in the whole
  global batch. ``CE_k`` is the drafter's cross-entropy on the target's argmax under either loss
  (``q_k`` estimates the chance greedy verification accepts slot k), ``L_k`` the loss trained
  (CE, or KL under ``loss: kl``). Every sum runs over the global batch inside one jit, so the loss
  does not depend on how the batch is split across devices or processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from dflash_jax.sharding import batch_shards, constrain

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The DFlash paper's decay by block size; other sizes fall back to (B-1)/2."""
    return DEFAULT_GAMMA.get(block_size, max(1.0, (block_size - 1) / 2))


def slot_weights(block_size: int, gamma: float | None = None, scheme: str = "decay") -> jax.Array:
    """[B] weights: w_0 = 0; decay: w_k = exp(-(k-1)/gamma); uniform: w_k = 1."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    if scheme == "decay":
        g = default_gamma(block_size) if gamma is None else gamma
        if g <= 0:
            raise ValueError(f"loss gamma must be positive, got {g}")
        w = jnp.exp(-(k - 1) / g)
    elif scheme == "uniform":
        w = jnp.ones_like(k)
    else:
        raise ValueError(f"unknown loss weighting {scheme!r} (decay | uniform; dpace: dpace_weights)")
    return w.at[0].set(0.0)


# The frozen [D, V] head as the loss uses it: whole hidden dim (gathered over fsdp once per step,
# outside the chunk loop), vocabulary split over tensor. The chunk's rows are split over the batch
# axes, so each device multiplies its own rows by its vocabulary slice, and the only collectives
# per chunk are the [C]-sized max/sum/argmax statistics over tensor and the [C, D] pullback sum.
# Left sharded over fsdp on D, XLA instead sums partial [C, V] logits over fsdp every chunk.
HEAD_AXES = (None, "vocab")


def lm_head_logits(lm_head: jax.Array, compute_dtype=jnp.float32) -> Callable[[jax.Array], jax.Array]:
    """Plain ``hidden @ lm_head`` (fp32 accumulation): the target's logits, or a drafter's that
    has no logit scale or soft-cap. The head is placed as ``HEAD_AXES``."""
    w = constrain(jax.lax.stop_gradient(lm_head).astype(compute_dtype), HEAD_AXES)

    def logits(h: jax.Array) -> jax.Array:
        return jnp.einsum("CD,DV->CV", h.astype(compute_dtype), w, preferred_element_type=jnp.float32)

    return logits


def even_chunks(n: int, chunk: int) -> tuple[int, int]:
    """(count, size) of the chunks that cover n items with at most ``chunk`` each: as few chunks as
    ``chunk`` allows, all of one size, so fewer than ``count`` items are padding instead of up to a
    whole chunk (3840 slots in chunks of at most 512: 8 x 480, not 8 x 512 with 256 padded rows
    going through two vocabulary-sized matmuls)."""
    if n < 1 or chunk < 1:
        raise ValueError(f"even_chunks needs n >= 1 and chunk >= 1, got n={n}, chunk={chunk}")
    count = math.ceil(n / chunk)
    return count, math.ceil(n / count)


def batch_chunks(x: jax.Array, chunk: int) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """x [N, ...] (items in batch-row order) -> ([n, S*c, ...], unchunk) for a ``lax.map`` over
    n chunks whose every chunk is split over the batch axes like the rows: each of the S
    ``batch_shards`` contributes c of its own N/S items to each chunk (``even_chunks(N/S, chunk)``),
    so no device computes another's items, and ``chunk`` bounds the items per device per chunk.
    ``unchunk`` maps a [n, S*c, ...] result back to [N, ...]. One device (or N not divisible by
    S): S = 1, the plain chunking."""
    N, rest = x.shape[0], x.shape[1:]
    S = batch_shards()
    if N % S:
        S = 1
    per = N // S
    n, c = even_chunks(per, chunk)
    x = jnp.pad(x.reshape(S, per, *rest), ((0, 0), (0, n * c - per)) + ((0, 0),) * len(rest))
    x = jnp.swapaxes(x.reshape(S, n, c, *rest), 0, 1).reshape(n, S * c, *rest)
    x = constrain(x, (None, "batch") + (None,) * len(rest))

    def unchunk(y: jax.Array) -> jax.Array:
        more = y.shape[2:]
        y = jnp.swapaxes(y.reshape(n, S, c, *more), 0, 1).reshape(S, n * c, *more)
        return y[:, :per].reshape(N, *more)

    return x, unchunk


def in_batch(x: jax.Array) -> jax.Array:
    """One chunk [C, ...] of ``batch_chunks`` kept split over the batch axes inside the loop."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def chunked_token_loss(
    draft_hidden: jax.Array,
    target_hidden: jax.Array | None,
    lm_head: jax.Array,
    *,
    draft_logits: Callable[[jax.Array], jax.Array] | None = None,
    kind: str = "ce",
    chunk: int = 1024,
    compute_dtype=jnp.float32,
    labels: jax.Array | None = None,
):
    """Per-item loss and correctness over N items without materialising [N, V].

    draft_hidden, target_hidden [N, D] (both final-normed); lm_head [D, V] (frozen, the target's).
    draft_logits: [C, D] drafter hidden -> [C, V] fp32 logits: the drafter's own logits function
    (the one decoding uses; training passes it). None: plain ``lm_head`` (no scale, no soft-cap).
    The target's logits are always ``target_hidden @ lm_head``.
    kind "ce": cross-entropy on the target's argmax; "kl": KL(target || draft) on full softmaxes.
    labels [N]: the target's argmax (an index into lm_head's columns) when already known. ce: the
    label trained (target_hidden is then unused); kl: the label ``correct`` and ``label_ce`` refer
    to (the distribution still comes from target_hidden). None: the argmax of the target's logits.
    Returns (loss [N] fp32, correct [N] bool, label [N] int32, label_ce [N] fp32): ``label_ce`` is
    the drafter's cross-entropy on ``label`` (= loss under ce; D-PACE's acceptance estimate under
    kl), without gradient.
    """
    if kind not in ("ce", "kl"):
        raise ValueError(f"unknown loss kind {kind!r} (ce | kl)")
    target_logits = lm_head_logits(lm_head, compute_dtype)
    if draft_logits is None:
        draft_logits = target_logits
    # Chunks split over the batch axes like the rows (``batch_chunks``), the head like HEAD_AXES.
    dh, unchunk = batch_chunks(draft_hidden, chunk)
    if labels is None or kind == "kl":
        if target_hidden is None:
            raise ValueError(f"chunked_token_loss needs target_hidden{' or labels' if kind == 'ce' else ''}")
        th = jax.lax.stop_gradient(target_hidden)
        th, _ = batch_chunks(th, chunk)

    if labels is not None:
        labels, _ = batch_chunks(labels.astype(jnp.int32), chunk)
    if kind == "ce":
        # Labels need no gradient: one pass for them over the target's logits.
        if labels is None:
            labels = jax.lax.map(
                lambda t: jnp.argmax(target_logits(in_batch(t)), axis=-1).astype(jnp.int32), th
            )
        aux = labels
    else:  # without labels, each chunk takes the argmax of the target logits it computes anyway
        aux = (th, labels)
    fused = _fused_chunk(draft_logits, target_logits, kind)
    loss, correct, label, label_ce = jax.lax.map(lambda args: fused(jax.tree.map(in_batch, args)), (dh, aux))
    return tuple(unchunk(x) for x in (loss, correct, label, label_ce))


def _fused_chunk(draft_logits, target_logits, kind: str):
    """One chunk's (loss, correct, label, label_ce), each [C], from drafter hidden d [C,D], with the
    loss's gradient w.r.t. d taken in the same pass (fused linear cross-entropy): the forward pass
    has the chunk's logits at hand, so it also pulls ``dloss/dlogits`` back through the logits
    function and keeps only that [C,D] result. The backward pass then scales it by the incoming per-item cotangent:
    two vocabulary-sized matmuls per chunk (logits, their pullback), as in a dense PyTorch step,
    where rematerialising the chunk in the backward pass costs a third. Exact because each item's
    loss depends on its own row of d only. The logits function's closed-over weights (the frozen
    lm_head, scale, soft-cap) get no gradient."""

    def forward(d, aux):
        logits, pullback = jax.vjp(lambda x: draft_logits(x).astype(jnp.float32), d)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)

        def ce_at(label):
            return lse[:, 0] - jnp.take_along_axis(logits, label[:, None], axis=-1)[:, 0]

        # Written as elementwise expressions of the [C,V] logits so XLA fuses them: no softmax or
        # log-softmax arrays of their own besides dlogits.
        if kind == "ce":
            label = aux
            loss = label_ce = ce_at(label)
            hot = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :] == label[:, None]
            dlogits = jnp.exp(logits - lse) - hot.astype(jnp.float32)
        else:
            t_hidden, label = aux
            t_logits = target_logits(t_hidden)
            if label is None:
                label = jnp.argmax(t_logits, axis=-1).astype(jnp.int32)
            label_ce = ce_at(label)
            t_lse = jax.nn.logsumexp(t_logits, axis=-1, keepdims=True)
            loss = jnp.sum(jnp.exp(t_logits - t_lse) * ((t_logits - t_lse) - (logits - lse)), axis=-1)
            dlogits = jnp.exp(logits - lse) - jnp.exp(t_logits - t_lse)
        (d_hidden,) = pullback(dlogits)
        return (loss, jnp.argmax(logits, axis=-1) == label, label, label_ce), d_hidden

    @jax.custom_vjp
    def chunk_loss(d, aux):
        return forward(d, aux)[0]

    def fwd(d, aux):
        return forward(d, aux)

    def bwd(d_hidden, cotangents):
        ct_loss = cotangents[0]
        return (ct_loss[:, None].astype(d_hidden.dtype) * d_hidden, None)

    chunk_loss.defvjp(fwd, bwd)
    return lambda args: chunk_loss(*args)


def dpace_weights(ce: jax.Array, trained: jax.Array, alpha: float = 0.5) -> jax.Array:
    """D-PACE slot weights [..., S] for slots 1..S of each block (no gradient flows through them).

    ce [..., S] per-slot cross-entropy of the drafter on the target's argmax (under ``loss: kl``
    too: not the KL), trained [..., S] bool. ``q_k = exp(-CE_k)`` estimates the chance greedy
    verification accepts slot k, ``P_k = prod_{i<=k} s_i`` with ``s_k = (1-alpha) q_k + alpha`` the
    (smoothed) chance the block gets that far, and ``w_k = sum_{m>=k} P_m`` over trained m: what
    getting slot k right is worth to the expected acceptance length. Untrained slots weigh 0.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in [0, 1], got {alpha}")
    q = jnp.exp(-jax.lax.stop_gradient(ce).astype(jnp.float32))
    s = jnp.where(trained, (1.0 - alpha) * q + alpha, 1.0)
    reach = jnp.where(trained, jnp.cumprod(s, axis=-1), 0.0)
    w = jnp.flip(jnp.cumsum(jnp.flip(reach, axis=-1), axis=-1), axis=-1)
    return jax.lax.stop_gradient(jnp.where(trained, w, 0.0))


def weighted_slot_loss(
    loss: jax.Array,
    trained: jax.Array,
    *,
    scheme: str = "decay",
    gamma: float | None = None,
    dpace_alpha: float = 0.5,
    label_ce: jax.Array | None = None,
) -> jax.Array:
    """Scalar training loss from per-slot losses [R, A, B-1] (slots 1..B-1) and their mask.

    decay/uniform: the weighted mean over trained slots; dpace: ``sum w_k loss_k`` divided by the
    global number of trained slots (see the module docstring). Sums run over the whole array.
    label_ce: the per-slot cross-entropy on the target's argmax D-PACE weights from (None: ``loss``,
    which is that cross-entropy under ``loss: ce``).
    """
    total = slot_loss_sum(
        loss, trained, scheme=scheme, gamma=gamma, dpace_alpha=dpace_alpha, label_ce=label_ce
    )
    return total / slot_loss_denominator(trained, scheme=scheme, gamma=gamma)


def slot_loss_sum(loss, trained, *, scheme="decay", gamma=None, dpace_alpha=0.5, label_ce=None) -> jax.Array:
    """The numerator: ``sum_k w_k loss_k`` over trained slots (rows may be a micro-batch: D-PACE
    weights depend only on each block's own slots; they come from ``label_ce`` as in
    :func:`weighted_slot_loss`)."""
    trained = trained.astype(bool)
    if scheme == "dpace":
        ce = loss if label_ce is None else label_ce
        return pairwise_sum(loss * dpace_weights(ce, trained, dpace_alpha))
    w = slot_weights(loss.shape[-1] + 1, gamma, scheme)[1:] * trained
    return pairwise_sum(loss * w)


def slot_loss_denominator(trained, *, scheme="decay", gamma=None) -> jax.Array:
    """The normaliser, over the whole batch: the trained-slot count (dpace) or the sum of the
    trained slots' weights (decay/uniform)."""
    trained = trained.astype(bool)
    if scheme == "dpace":
        return jnp.maximum(jnp.sum(trained), 1).astype(jnp.float32)
    w = slot_weights(trained.shape[-1] + 1, gamma, scheme)[1:] * trained
    return jnp.maximum(pairwise_sum(w), 1e-6)


def pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum of all of ``x`` as a fixed tree of elementwise adds: the same fp32 result on any mesh
    layout (a plain ``jnp.sum`` of ~1e3 loss terms differs by ~5e-6 relative between one device
    and a sharded batch, and its one-device sequential order is the less accurate one)."""
    # Replicated first: slicing a batch-sharded array log2(n) times makes XLA's SPMD partitioner
    # emit collective-permutes that deadlock on some layouts (data 2 x tensor 4 on CPU); the
    # terms are few (rows x anchors x slots), so every device sums all of them itself.
    x = constrain(x.reshape(-1).astype(jnp.float32), (None,))
    n = 1 << max(0, (x.size - 1).bit_length())
    x = jnp.pad(x, (0, n - x.size))
    while x.size > 1:
        x = x[: x.size // 2] + x[x.size // 2 :]
    return x[0]


def target_argmax(hidden: jax.Array, lm_head: jax.Array, *, chunk: int = 1024):
    """[..., D] final normed target hidden -> [...] argmax of the target's logits, chunked; always in
    the target's own dtype (``lm_head``'s): the labels are the target's real output (invariant 2),
    which a drafter computing in bf16 would flip at near ties (0.5 % of the demo's labels with an
    fp32 target)."""
    lead, D = hidden.shape[:-1], hidden.shape[-1]
    flat, unchunk = batch_chunks(jax.lax.stop_gradient(hidden).reshape(-1, D), chunk)
    logits = lm_head_logits(lm_head, lm_head.dtype)

    def one(h):
        return jnp.argmax(logits(in_batch(h)), axis=-1).astype(jnp.int32)

    return unchunk(jax.lax.map(one, flat)).reshape(lead)


def block_metrics(correct: jax.Array, item_mask: jax.Array, anchor_valid: jax.Array):
    """correct/item_mask [R,A,B-1] for slots 1..B-1; anchor_valid [R,A].

    Returns per-slot accuracy [B-1] and the teacher-forced streak: the mean over valid anchors of
    1 + sum_k prod_{i<=k} correct_i (a masked slot ends the streak).
    """
    ok = correct & item_mask
    denom = jnp.maximum(jnp.sum(item_mask, axis=(0, 1)), 1)
    per_slot = jnp.sum(ok, axis=(0, 1)) / denom
    run = jnp.cumprod(ok.astype(jnp.float32), axis=-1)
    streak = 1.0 + jnp.sum(run, axis=-1)
    n_valid = jnp.maximum(jnp.sum(anchor_valid), 1)
    mean_streak = jnp.sum(jnp.where(anchor_valid, streak, 0.0)) / n_valid
    return per_slot, mean_streak
