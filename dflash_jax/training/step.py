"""One training step: frozen target forward -> anchors -> drafter -> chunked loss -> optax update.

Everything here is traced under one ``jax.jit``; the batch walks data -> target -> drafter -> loss
-> optimizer without coming back. Labels are the target's own final logits (invariant 2); the
drafter's input features may be noised, the hidden state that makes the labels never is.

The step reads its settings straight from the run config's ``train`` section
(:class:`~dflash_jax.training.run_config.TrainSection`); block size and target taps come from the
drafter's own config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dflash_jax.dtypes import to_dtype
from dflash_jax.training.anchors import sample_anchors, slot_targets
from dflash_jax.training.loss import block_metrics, chunked_token_loss, target_argmax, weighted_slot_loss

if TYPE_CHECKING:
    from dflash_jax.training.run_config import TrainSection


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
    once it knows how many steps fit in the time budget (``loop.learning_rate``)."""
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
):
    """Weighted loss of the drafter's slots 1..B-1 (slot 0 is the given token: never trained).

    draft [R,A,B,D] drafter output; hidden [R,T,D] the target's final normed hidden state;
    draft_logits: the drafter's logits function, [C,D] -> [C,V] (``drafter.logits``, the one
    decoding uses; None: plain lm_head). Which slots train: ``anchors.slot_targets``.
    """
    R, A, B, D = draft.shape
    label_pos, item_mask = slot_targets(anchors, anchor_valid, loss_mask, segment_ids, B)
    dtype = to_dtype(cfg.compute_dtype)
    if cfg.loss == "ce":
        # Blocks overlap, so the target's argmax is taken once per position and gathered per slot.
        per_position = target_argmax(hidden, lm_head, chunk=cfg.loss_chunk, compute_dtype=dtype)  # [R,T]
        slot_labels = gather_positions(per_position, label_pos).reshape(-1)
        target_h = None
    else:
        slot_labels = None
        target_h = gather_positions(hidden, label_pos).reshape(-1, D)
    loss_i, correct, labels = chunked_token_loss(
        draft[:, :, 1:].reshape(-1, D),
        target_h,
        lm_head,
        draft_logits=draft_logits,
        kind=cfg.loss,
        chunk=cfg.loss_chunk,
        compute_dtype=dtype,
        labels=slot_labels,
    )
    loss = weighted_slot_loss(
        loss_i.reshape(R, A, B - 1),
        item_mask,
        scheme=cfg.loss_weighting,
        gamma=cfg.gamma,
        dpace_alpha=cfg.dpace_alpha,
    )
    per_slot, streak = block_metrics(correct.reshape(R, A, B - 1), item_mask, anchor_valid)
    return loss, {"streak": streak, "slot_acc": per_slot, "labels": labels.reshape(R, A, B - 1)}


def drafter_loss(drafter, target, batch, key, cfg: TrainSection, *, with_labels: bool = False):
    """Returns (loss, metrics dict). Differentiable w.r.t. the drafter only.
    ``with_labels`` adds the slot labels [R,A,B-1] the loss used (for tests and debugging)."""
    k_anchor, k_noise = jax.random.split(key)
    features, hidden = target_pass(target, batch, drafter.config.target_layer_ids)
    if cfg.feature_noise_std > 0:
        features = features + cfg.feature_noise_std * jax.random.normal(
            k_noise, features.shape, features.dtype
        )
    anchors, valid = sample_anchors(
        k_anchor,
        batch["loss_mask"],
        batch["segment_ids"],
        max_anchors=cfg.max_anchors,
    )
    embeds = drafter.train_block_embeds(target, batch["input_ids"], anchors)
    draft = drafter.forward_train(features, batch["positions"], batch["segment_ids"], anchors, valid, embeds)
    dtype = to_dtype(cfg.compute_dtype)
    loss, extra = block_loss(
        draft,
        hidden,
        anchors,
        valid,
        batch["loss_mask"],
        batch["segment_ids"],
        target.lm_head_weight(),
        cfg,
        draft_logits=lambda h: drafter.logits(h, target, compute_dtype=dtype),
    )
    metrics = {
        "loss": loss,
        "streak": extra["streak"],
        "slot_acc": extra["slot_acc"],
        "anchors": jnp.sum(valid),
        "tokens": jnp.sum(batch["segment_ids"] != 0),
    }
    if with_labels:
        metrics["labels"] = extra["labels"]
    return loss, metrics


def make_train_step(cfg: TrainSection):
    @nnx.jit(donate_argnums=(0, 1))
    def train_step(drafter, optimizer, target, batch, key, learning_rate):
        def loss_fn(model):
            return drafter_loss(model, target, batch, key, cfg)

        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(drafter)
        metrics["grad_norm"] = optax.global_norm(grads)
        optimizer.update(drafter, grads, learning_rate=learning_rate)
        metrics["learning_rate"] = learning_rate
        return metrics

    return train_step


def make_eval_step(cfg: TrainSection):
    @nnx.jit
    def eval_step(drafter, target, batch, key):
        return drafter_loss(drafter, target, batch, key, cfg)[1]

    return eval_step
