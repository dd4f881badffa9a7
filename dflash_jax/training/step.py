"""One training step: frozen target forward (or its offline cache) -> anchors -> drafter -> chunked loss -> optax update.

Everything here is traced under one ``jax.jit``; the batch walks data -> target -> drafter -> loss
-> optimizer without coming back. Labels are the target's own final logits (invariant 2); the
drafter's input features may be noised, the hidden state that makes the labels never is.

The step reads its settings straight from the run config's ``train`` section
(:class:`~dflash_jax.training.run_config.TrainSection`); block size and target taps come from the
drafter's own config.

Precision: the drafter's parameters, gradients and optimizer state are float32; its activations
are its config's ``compute_dtype`` (``train.activation_dtype``) and its products, the vocabulary
head's included, ``train.compute_dtype``; logits, the loss and its normaliser are float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dflash_jax.dtypes import to_dtype
from dflash_jax.sharding import constrain
from dflash_jax.training.anchors import greedy_slots, sample_anchors, slot_targets
from dflash_jax.training.loss import (
    HEAD_AXES,
    block_metrics,
    chunked_token_loss,
    slot_loss_denominator,
    slot_loss_sum,
    target_argmax,
)

if TYPE_CHECKING:
    from dflash_jax.training.run_config import TrainSection

# What the drafter's backward pass may keep from its forward (``train.remat``).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def scale_by_learning_rate_arg() -> optax.GradientTransformationExtraArgs:
    """``-learning_rate * updates`` with the rate passed to every update call (``learning_rate=``)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, learning_rate, **extra):
        del params, extra
        return jax.tree.map(lambda u: (-learning_rate * u).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(train_cfg: TrainSection) -> optax.GradientTransformation:
    """AdamW as ``optax.adamw`` builds it (Adam, decoupled weight decay, times -rate) after global
    norm clipping; the rate is an argument of each step, so the loop can fix the schedule's length
    once it knows how many steps fit in the time budget (``schedule.learning_rate``)."""
    return optax.chain(
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.scale_by_adam(b1=train_cfg.b1, b2=train_cfg.b2),
        optax.add_decayed_weights(train_cfg.weight_decay),
        scale_by_learning_rate_arg(),
    )


def target_pass(target, batch, layer_ids: tuple[int, ...]):
    """Frozen target: features of the tapped layers ``layer_ids`` and the final normed hidden state."""
    out = target(
        batch["input_ids"],
        batch["positions"],
        segment_ids=batch["segment_ids"],
        layer_ids=tuple(layer_ids),
        return_logits=False,
    )
    return jax.lax.stop_gradient(out.features), jax.lax.stop_gradient(out.hidden)


def target_outputs(target, batch, layer_ids: tuple[int, ...]):
    """(features, hidden, per-position labels) of a batch: read from it when it carries the offline
    feature cache's arrays (``data.features``, see training/feature_cache.py: ``features`` and
    ``labels``, plus ``hidden`` for ``kl``), else from a frozen target pass (labels None:
    ``block_loss`` takes the argmax itself). Which branch runs is fixed when the step is traced."""
    if "features" not in batch:
        return (*target_pass(target, batch, layer_ids), None)
    return batch["features"], batch.get("hidden"), batch.get("labels")


def gather_positions(x, pos):
    """x [R,T,...] at pos [R,...] -> [R,..., ...]: per-row gather along T."""
    R = x.shape[0]
    flat = pos.reshape(R, -1)
    idx = flat.reshape(*flat.shape, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, idx, axis=1).reshape(*pos.shape, *x.shape[2:])


def block_loss(
    draft,
    hidden,
    anchors,
    anchor_valid,
    loss_mask,
    segment_ids,
    lm_head,
    cfg: TrainSection,
    draft_logits=None,
    position_labels=None,
    draft_vocab=None,
    draft_head=None,
    input_ids=None,
):
    """Weighted loss of the drafter's slots 1..B-1 (slot 0 is the given token: never trained).

    draft [R,A,B,D] drafter output; hidden [R,T,D] the target's final normed hidden state;
    position_labels [R,T]: the target's argmax per position, already computed (the offline
    feature cache's; under ``ce`` ``hidden`` may then be None), else taken from ``hidden``;
    draft_logits: the drafter's logits function, [C,D] -> [C,N] (``drafter.logits``, the one
    decoding uses; None: plain lm_head). Which slots train: ``anchors.slot_targets``.
    draft_vocab [N] int32: the target ids the drafter's N logits stand for (invariant 9), or None
    (N = V). Under both losses a slot whose label (the target's argmax over all V) is outside them
    is left out of the loss, numerator and normaliser alike, counted (``label_coverage``) and
    scored wrong (``slot_acc``, streak: right only when the drafter's argmax is that label);
    ``kl`` trains the other slots on the target's distribution restricted to the N ids and
    renormalised (over ``draft_head``, the drafter's already gathered ``lm_head[:, draft_vocab]``,
    when given: one gather per step). D-PACE weighs every slot by the drafter's cross-entropy on
    its label, under ``kl`` too.
    input_ids [R,T]: the batch's tokens, for ``train.greedy_slots`` (a slot off the target's greedy
    path carries no loss; ``anchors.greedy_slots``).
    """
    R, A, B, D = draft.shape
    label_pos, item_mask = slot_targets(anchors, anchor_valid, loss_mask, segment_ids, B)
    dtype = to_dtype(cfg.compute_dtype)
    in_vocab = jnp.ones_like(item_mask)
    head = lm_head
    # Under both losses a slot's label is the target's argmax over all V: ce trains it; it decides
    # whether a draft vocabulary holds the slot and whether the drafter's argmax is right. Blocks
    # overlap, so it is taken once per position and gathered per slot.
    per_position = position_labels
    if per_position is None:
        per_position = target_argmax(hidden, lm_head, chunk=cfg.loss_chunk)  # [R,T]
    labels = gather_positions(per_position, label_pos).reshape(-1)  # target ids
    slot_labels = labels  # indices into the drafter's logits: draft ids with a draft vocabulary
    if draft_vocab is not None:
        to_draft = jnp.full((lm_head.shape[1],), -1, jnp.int32)
        to_draft = to_draft.at[draft_vocab].set(jnp.arange(draft_vocab.shape[0], dtype=jnp.int32))
        draft_labels = to_draft[labels]
        in_vocab = (draft_labels >= 0).reshape(R, A, B - 1)
        slot_labels = jnp.maximum(draft_labels, 0)
    target_h = None
    if cfg.loss == "kl":
        target_h = gather_positions(hidden, label_pos).reshape(-1, D)
        if draft_vocab is not None:  # the drafter's own N rows when the caller has them gathered
            head = draft_head if draft_head is not None else jnp.take(lm_head, draft_vocab, axis=1)
            head = jax.lax.stop_gradient(head)
    loss_i, correct, _, label_ce = chunked_token_loss(
        draft[:, :, 1:].reshape(-1, D),
        target_h,
        head,
        draft_logits=draft_logits,
        kind=cfg.loss,
        chunk=cfg.loss_chunk,
        compute_dtype=dtype,
        labels=slot_labels,
    )
    covered = item_mask & in_vocab
    trained = covered
    if getattr(cfg, "greedy_slots", False):
        if input_ids is None:
            raise ValueError("train.greedy_slots needs the batch's input_ids in block_loss")
        trained = covered & greedy_slots(input_ids, label_pos, labels.reshape(R, A, B - 1))
    correct = correct.reshape(R, A, B - 1) & in_vocab
    loss_sum = slot_loss_sum(
        loss_i.reshape(R, A, B - 1),
        trained,
        scheme=cfg.loss_weighting,
        gamma=cfg.gamma,
        dpace_alpha=cfg.dpace_alpha,
        label_ce=label_ce.reshape(R, A, B - 1),
    )
    denominator = slot_loss_denominator(trained, scheme=cfg.loss_weighting, gamma=cfg.gamma)
    per_slot, streak = block_metrics(correct, item_mask, anchor_valid)
    return loss_sum / denominator, {
        "streak": streak,
        "slot_acc": per_slot,
        "labels": labels.reshape(R, A, B - 1),
        "trained": trained,
        "loss_sum": loss_sum,
        "loss_denominator": denominator,
        "slot_count": jnp.sum(item_mask, axis=(0, 1)),
        "in_vocab_count": jnp.sum(covered),
    }


def _anchors(key, batch, cfg: TrainSection):
    return sample_anchors(key, batch["loss_mask"], batch["segment_ids"], max_anchors=cfg.max_anchors)


def _drafter_forward(drafter, features, positions, segment_ids, anchors, valid, embeds):
    return drafter.forward_train(features, positions, segment_ids, anchors, valid, embeds)


def _block_forward(cfg: TrainSection):
    """``DFlashDrafter.forward_blocks`` under ``train.remat``'s policy."""

    def forward(drafter, context, positions, segment_ids, anchors, valid, embeds):
        return drafter.forward_blocks(context, positions, segment_ids, anchors, valid, embeds)

    remat = getattr(cfg, "remat", "none")
    return forward if remat == "none" else nnx.remat(forward, policy=REMAT_POLICIES[remat])


def drafter_loss(drafter, target, batch, key, cfg: TrainSection, *, with_labels: bool = False, anchors=None):
    """Returns (loss, metrics dict). Differentiable w.r.t. the drafter only.
    ``with_labels`` adds the slot labels [R,A,B-1] the loss used (for tests and debugging).
    ``anchors``: (anchors, valid) already drawn (micro-batching draws them for the whole batch)."""
    k_anchor, k_noise = jax.random.split(key)
    features, hidden, position_labels = target_outputs(target, batch, drafter.config.target_layer_ids)
    if cfg.feature_noise_std > 0:
        features = features + cfg.feature_noise_std * jax.random.normal(
            k_noise, features.shape, features.dtype
        )
    if anchors is None:
        anchors = _anchors(k_anchor, batch, cfg)
    anchors, valid = anchors
    embeds = drafter.train_block_embeds(target, batch["input_ids"], anchors)
    remat = getattr(cfg, "remat", "none")
    forward = (
        _drafter_forward if remat == "none" else nnx.remat(_drafter_forward, policy=REMAT_POLICIES[remat])
    )
    draft = forward(drafter, features, batch["positions"], batch["segment_ids"], anchors, valid, embeds)
    dtype = to_dtype(cfg.compute_dtype)
    # The N rows of lm_head, gathered once (and placed as the loss's HEAD_AXES), not per loss chunk.
    head = constrain(drafter.head_weight(target), HEAD_AXES)
    draft_vocab = None if drafter.draft_vocab is None else drafter.draft_vocab[...]
    loss, extra = block_loss(
        draft,
        hidden,
        anchors,
        valid,
        batch["loss_mask"],
        batch["segment_ids"],
        target.lm_head_weight(),
        cfg,
        draft_logits=lambda h: drafter.logits(h, target, compute_dtype=dtype, head=head),
        position_labels=position_labels,
        draft_vocab=draft_vocab,
        draft_head=head,
        input_ids=batch["input_ids"],
    )
    metrics = {
        "loss_sum": extra["loss_sum"],
        "loss_denominator": extra["loss_denominator"],
        "slot_count": extra["slot_count"],
        "in_vocab_count": extra["in_vocab_count"],
        "loss": loss,
        "streak": extra["streak"],
        "slot_acc": extra["slot_acc"],
        "anchors": jnp.sum(valid),
        "tokens": jnp.sum(batch["segment_ids"] != 0),
    }
    if with_labels:
        metrics["labels"] = extra["labels"]
    return loss, metrics


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _pure(module, var_type):
    return nnx.to_pure_dict(nnx.state(module, var_type))


def _assign(module, var_type, pure) -> None:
    state = nnx.state(module, var_type)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(module, state)


def apply_train_step(drafter, optimizer, target, batch, key, cfg: TrainSection, learning_rate) -> dict:
    """One optimizer update of ``drafter`` in place at ``learning_rate``; returns the step's metrics. Traced by the
    trainer's jitted step and by the AOT planner, both through ``jit_train_step``.

    A step whose loss, gradients or updated parameters are not all finite, or whose update is
    blown up (its norm more than ``train.max_update_ratio`` times the parameters' norm: finite
    parameters of 1e30 are as lost as NaN ones), applies no update at all (parameters and
    optimizer state, step counter included, stay as they were, like optax's ``apply_if_finite``)
    and reports ``skipped = 1``; the trainer counts these and stops after a configured number in a
    row, so every checkpointed parameter comes from steps that passed this check."""
    if getattr(cfg, "micro_batches", 1) == 1 and getattr(cfg, "anchor_chunks", 1) == 1:

        def loss_fn(model):
            return drafter_loss(model, target, batch, key, cfg)

        (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(drafter)
    else:
        grads, metrics = accumulated_grads(drafter, target, batch, key, cfg)
    metrics.pop("loss_sum"), metrics.pop("loss_denominator")
    slot_count, in_vocab = metrics.pop("slot_count"), metrics.pop("in_vocab_count")
    # The fraction of trained slots whose label the drafter can produce (1 without a draft vocabulary).
    metrics["label_coverage"] = in_vocab / jnp.maximum(jnp.sum(slot_count), 1)
    metrics["grad_norm"] = optax.global_norm(grads)
    old_params = _pure(drafter, nnx.Param)
    old_opt = _pure(optimizer, nnx.optimizer.OptState)
    optimizer.update(drafter, grads, learning_rate=learning_rate)
    new_params = _pure(drafter, nnx.Param)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]) & _all_finite(new_params)
    max_ratio = getattr(cfg, "max_update_ratio", None)
    if max_ratio is not None:
        delta = jax.tree.map(lambda n, o: (n - o).astype(jnp.float32), new_params, old_params)
        ratio = optax.global_norm(delta) / jnp.maximum(optax.global_norm(old_params), 1e-12)
        metrics["update_ratio"] = ratio
        ok = ok & (ratio <= max_ratio)  # a NaN or inf ratio fails too

    def keep(new, old):
        return jnp.where(ok, new, old)

    _assign(drafter, nnx.Param, jax.tree.map(keep, new_params, old_params))
    _assign(
        optimizer,
        nnx.optimizer.OptState,
        jax.tree.map(keep, _pure(optimizer, nnx.optimizer.OptState), old_opt),
    )
    metrics["skipped"] = 1 - ok.astype(jnp.int32)
    metrics["learning_rate"] = learning_rate
    return metrics


def accumulated_grads(drafter, target, batch, key, cfg: TrainSection):
    """Gradient of the full batch's loss from ``cfg.micro_batches`` sequential passes over row groups,
    each pass over ``cfg.anchor_chunks`` chunks of its rows' anchors (``anchor_chunked_grads``).

    Anchors are drawn once for the whole batch; each pass adds the gradient of its loss *sum*, and
    the total is divided by the whole batch's normaliser (the sum of the passes' ones, which carry
    no gradient) at the end, so the update equals the full-batch one (up to float summation
    order) whatever the normaliser depends on (the trained slots, the draft vocabulary's label
    coverage). Only the feature-noise draws (``feature_noise_std > 0``) differ.
    """
    M = cfg.micro_batches
    R = batch["input_ids"].shape[0]
    if R % M:
        raise ValueError(f"train.micro_batches={M} does not divide the batch's {R} rows")
    k_anchor, k_rest = jax.random.split(key)
    anchors, valid = _anchors(k_anchor, batch, cfg)

    def split(x):
        return x.reshape(M, R // M, *x.shape[1:])

    xs = ({k: split(v) for k, v in batch.items()}, split(anchors), split(valid), jax.random.split(k_rest, M))
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)

    def one(grad_acc, x):
        mb, a, v, k = x
        if getattr(cfg, "anchor_chunks", 1) > 1:
            g, m = anchor_chunked_grads(graphdef, params, rest, target, mb, k, cfg, (a, v))
            return jax.tree.map(jnp.add, grad_acc, g), m

        def loss_fn(p):
            model = nnx.merge(graphdef, p, rest)
            _, m = drafter_loss(model, target, mb, k, cfg, anchors=(a, v))
            return m["loss_sum"], m

        (_, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(jnp.add, grad_acc, g), m

    grad_sum, per = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, params), xs)
    # decay/uniform: the normaliser is a sum of per-pass sums; dpace: of per-pass counts.
    denom = jnp.maximum(jnp.sum(per["loss_denominator"]), 1e-6)
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    n_valid = jnp.sum(split(valid), axis=(1, 2))  # [M]
    slot_count = per["slot_count"]  # [M, B-1]
    metrics = {
        "loss": jnp.sum(per["loss_sum"]) / denom,
        "streak": jnp.sum(per["streak"] * n_valid) / jnp.maximum(jnp.sum(n_valid), 1),
        "slot_acc": jnp.sum(per["slot_acc"] * slot_count, axis=0)
        / jnp.maximum(jnp.sum(slot_count, axis=0), 1),
        "anchors": jnp.sum(per["anchors"]),
        "tokens": jnp.sum(per["tokens"]),
        "loss_sum": jnp.sum(per["loss_sum"]),
        "loss_denominator": denom,
        "slot_count": jnp.sum(slot_count, axis=0),
        "in_vocab_count": jnp.sum(per["in_vocab_count"]),
    }
    return grads, metrics


def anchor_chunked_grads(graphdef, params, rest, target, batch, key, cfg: TrainSection, anchors):
    """Gradient of one pass's loss *sum* with its rows' anchors in ``cfg.anchor_chunks`` sequential
    chunks, and the pass's metrics (``drafter_loss``'s, with ``loss_sum`` and ``loss_denominator``).

    Blocks never see each other (invariant 3) and the loss is a sum over slots, so each chunk's
    blocks give exactly their share: the target pass, the per-position labels and every layer's
    context K/V [R, T, K, H] are computed once, then a ``lax.scan`` runs each chunk's drafter
    forward, loss and backward (gradients w.r.t. the parameters and the context K/V, summed over
    chunks), and the context's own backward runs once at the end. Memory is one chunk's blocks
    (A / anchor_chunks per row) at a time, with no recompute (``train.remat`` applies inside a
    chunk). The normaliser is taken over all chunks' trained slots at once, as the unchunked
    step takes it. ``anchors``: (anchors, valid) [R, A] drawn for the whole batch."""
    C = cfg.anchor_chunks
    anchors, valid = anchors
    R, A = anchors.shape
    if A % C:
        raise ValueError(
            f"train.anchor_chunks={C} does not divide the {A} anchors of a row (train.max_anchors)"
        )
    drafter = nnx.merge(graphdef, params, rest)
    _, k_noise = jax.random.split(key)  # drafter_loss's split: the same noise for the same key
    features, hidden, position_labels = target_outputs(target, batch, drafter.config.target_layer_ids)
    if cfg.feature_noise_std > 0:
        features = features + cfg.feature_noise_std * jax.random.normal(
            k_noise, features.shape, features.dtype
        )
    lm_head = target.lm_head_weight()
    if position_labels is None:  # once for all chunks: blocks overlap, and so do the chunks' labels
        position_labels = target_argmax(hidden, lm_head, chunk=cfg.loss_chunk)
    embeds = drafter.train_block_embeds(target, batch["input_ids"], anchors)
    positions, segment_ids = batch["positions"], batch["segment_ids"]
    context, context_vjp = jax.vjp(
        lambda p: nnx.merge(graphdef, p, rest).train_context(features, positions), params
    )
    forward = _block_forward(cfg)
    dtype = to_dtype(cfg.compute_dtype)

    def chunk_loss(p, context, a, v, e):
        model = nnx.merge(graphdef, p, rest)
        draft = forward(model, context, positions, segment_ids, a, v, e)
        head = constrain(model.head_weight(target), HEAD_AXES)
        _, extra = block_loss(
            draft, hidden, a, v, batch["loss_mask"], segment_ids, lm_head, cfg,
            draft_logits=lambda h: model.logits(h, target, compute_dtype=dtype, head=head),
            position_labels=position_labels,
            draft_vocab=None if model.draft_vocab is None else model.draft_vocab[...],
            draft_head=head, input_ids=batch["input_ids"],
        )  # fmt: skip
        keep = ("loss_sum", "trained", "streak", "slot_acc", "slot_count", "in_vocab_count")
        return extra["loss_sum"], {k: extra[k] for k in keep} | {"anchors": jnp.sum(v)}

    def one(acc, x):
        (_, m), g = jax.value_and_grad(chunk_loss, argnums=(0, 1), has_aux=True)(params, context, *x)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g), m

    def split(x):  # [R, A, ...] -> [C, R, A / C, ...]: contiguous chunks keep anchors sorted
        x = jnp.moveaxis(x.reshape(R, C, A // C, *x.shape[2:]), 1, 0)
        return constrain(x, (None, "batch") + (None,) * (x.ndim - 2))

    # The context's gradient is summed over chunks in fp32 (its activations may be bf16).
    zeros = jax.tree.map(
        lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), (params, context)
    )
    (g_params, g_context), per = jax.lax.scan(one, zeros, (split(anchors), split(valid), split(embeds)))
    (g_from_context,) = context_vjp(jax.tree.map(lambda g, x: g.astype(x.dtype), g_context, context))
    grads = jax.tree.map(jnp.add, g_params, g_from_context)
    trained = jnp.moveaxis(per["trained"], 0, 1).reshape(R, A, -1)
    denominator = slot_loss_denominator(trained, scheme=cfg.loss_weighting, gamma=cfg.gamma)
    loss_sum = jnp.sum(per["loss_sum"])
    n_valid = per["anchors"]  # [C]
    slot_count = per["slot_count"]  # [C, B-1]
    metrics = {
        "loss_sum": loss_sum,
        "loss_denominator": denominator,
        "slot_count": jnp.sum(slot_count, axis=0),
        "in_vocab_count": jnp.sum(per["in_vocab_count"]),
        "loss": loss_sum / denominator,
        "streak": jnp.sum(per["streak"] * n_valid) / jnp.maximum(jnp.sum(n_valid), 1),
        "slot_acc": jnp.sum(per["slot_acc"] * slot_count, axis=0)
        / jnp.maximum(jnp.sum(slot_count, axis=0), 1),
        "anchors": jnp.sum(n_valid),
        "tokens": jnp.sum(segment_ids != 0),
    }
    return grads, metrics


def jit_train_step(
    drafter_graph,
    target_graph,
    cfg: TrainSection,
    *,
    donate: bool = True,
    state_shardings=None,
    keep_unused: bool = False,
):
    """The training step as one ``jax.jit`` over pure states: the program the trainer runs and the
    planner (``dflash_jax.tools.plan``) compiles on abstract weights, so a plan is a plan of it.

    ``train_step(state, target_state, batch, key, learning_rate) -> (new state, metrics)``, where
    ``state`` and ``target_state`` are ``nnx.split((drafter, optimizer))``'s and ``nnx.split(target)``'s
    states under these graphs: arrays, or ``ShapeDtypeStruct``s with shardings to lower. The rate is
    traced (the schedule never recompiles). ``donate``: the new state reuses the old one's buffers;
    ``state_shardings``: the new state's layout (the old one's: the next step sees the inputs this
    one compiled for, and donated buffers alias); ``keep_unused``: keep every target weight an
    argument even when the step reads only a few (a feature-cache step), as memory plans count them.
    """

    def train_step(state, target_state, batch, key, learning_rate):
        drafter, optimizer = nnx.merge(drafter_graph, state)
        target = nnx.merge(target_graph, target_state)
        metrics = apply_train_step(drafter, optimizer, target, batch, key, cfg, learning_rate)
        return nnx.state((drafter, optimizer)), metrics

    return jax.jit(
        train_step,
        donate_argnums=(0,) if donate else (),
        out_shardings=None if state_shardings is None else (state_shardings, None),
        keep_unused=keep_unused,
    )


def array_shardings(state):
    """The sharding of every leaf of an nnx state (arrays or ``ShapeDtypeStruct``s)."""
    return jax.tree.map(lambda x: x.sharding, state)


class TrainStep:
    """The trainer's side of :func:`jit_train_step`: called on live modules, it splits them, runs the
    jitted step (the drafter's and optimizer's buffers donated, their layout kept) and writes the
    new state back into them in place. One compile per module structure, as ``nnx.jit`` did."""

    def __init__(self, cfg: TrainSection):
        self.cfg = cfg
        self._graphs = None
        self._jitted = None

    def _pure_args(self, drafter, optimizer, target):
        drafter_graph, state = nnx.split((drafter, optimizer))
        target_graph, target_state = nnx.split(target)
        if self._graphs != (drafter_graph, target_graph):
            self._graphs = (drafter_graph, target_graph)
            self._jitted = jit_train_step(
                drafter_graph,
                target_graph,
                self.cfg,
                state_shardings=array_shardings(state),
                # As the planner compiles it (XLA drops dead code either way): every target
                # weight an argument, so a plan's arguments are the run's.
                keep_unused=True,
            )
        return state, target_state

    def __call__(self, drafter, optimizer, target, batch, key, learning_rate) -> dict:
        state, target_state = self._pure_args(drafter, optimizer, target)
        new_state, metrics = self._jitted(state, target_state, batch, key, learning_rate)
        nnx.update((drafter, optimizer), new_state)
        return metrics

    def lower(self, drafter, optimizer, target, batch, key, learning_rate):
        """The step's ``jax.stages.Lowered`` for these modules and inputs (nothing runs)."""
        state, target_state = self._pure_args(drafter, optimizer, target)
        return self._jitted.lower(state, target_state, batch, key, learning_rate)


def make_train_step(cfg: TrainSection) -> TrainStep:
    """``train_step(drafter, optimizer, target, batch, key, learning_rate) -> metrics``, updating the
    drafter and optimizer in place (see :class:`TrainStep`)."""
    return TrainStep(cfg)


def make_eval_step(cfg: TrainSection):
    @nnx.jit
    def eval_step(drafter, target, batch, key):
        return drafter_loss(drafter, target, batch, key, cfg)[1]

    return eval_step
