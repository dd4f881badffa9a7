"""Gradient accumulation (train.micro_batches) and drafter remat give the full-batch update."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fixtures import tiny_target_config
from flax import nnx

from dflash_jax.drafter.api import get_params, init_drafter
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.target.model import TargetModel
from dflash_jax.training.run_config import TrainSection
from dflash_jax.training.step import apply_train_step

B = 4


def _setup():
    tc = tiny_target_config()
    target = TargetModel(tc, rngs=nnx.Rngs(0))
    target.embed_tokens[...] = target.embed_tokens[...] * 20.0  # peaked target distributions
    dc = DrafterConfig.for_target(tc, num_layers=1, mask_token_id=255, block_size=B, target_layer_ids=(0, 2))
    return target, dc


def _batch(R=4, T=48):
    rng = np.random.default_rng(0)
    seg = np.ones((R, T), np.int32)
    seg[::2, 30:] = 2  # two documents in every other row
    pos = np.where(seg == 2, np.arange(T) - 30, np.arange(T)).astype(np.int32)
    loss_mask = (pos >= 6).astype(np.int32)
    loss_mask[1, :] = 0  # a row with nothing to train: its share of the weights is zero
    return {
        "input_ids": jnp.asarray(rng.integers(0, 250, (R, T)), jnp.int32),
        "positions": jnp.asarray(pos),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray(loss_mask),
    }


@functools.lru_cache(maxsize=4)  # the full-batch reference is shared by the parametrized cases
def _one_step(cfg: TrainSection):
    target, dc = _setup()
    drafter = init_drafter(dc, target, 3)
    optimizer = nnx.Optimizer(drafter, optax.sgd(1.0), wrt=nnx.Param)  # update == -gradient
    # sgd(1.0) ignores the learning-rate argument of the step
    step = nnx.jit(lambda d, o, t, b, k: apply_train_step(d, o, t, b, k, cfg, 1.0))
    metrics = step(drafter, optimizer, target, _batch(), jax.random.key(7))
    return get_params(drafter), jax.tree.map(np.asarray, metrics)


@pytest.mark.parametrize("micro_batches,remat", [(2, "none"), (4, "full"), (1, "dots")])
def test_accumulated_update_equals_full_batch(micro_batches, remat):
    want_params, want = _one_step(TrainSection(max_anchors=6, loss_chunk=16))
    got_params, got = _one_step(
        TrainSection(max_anchors=6, loss_chunk=16, micro_batches=micro_batches, remat=remat)
    )
    init_params = get_params(init_drafter(_setup()[1], None, 3))
    moved = jax.tree.leaves(
        jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), want_params, init_params)
    )
    assert max(moved) > 1e-4  # the step really moved the weights
    for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(got_params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6, rtol=1e-4)
    for k in ("loss", "streak", "slot_acc", "anchors", "tokens", "grad_norm"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_micro_batches_must_divide_rows():
    cfg = TrainSection(max_anchors=6, loss_chunk=16, micro_batches=3)
    with pytest.raises(ValueError, match="train.micro_batches=3 does not divide the batch's 4 rows"):
        _one_step(cfg)
