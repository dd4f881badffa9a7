"""train.greedy_slots: only the slots greedy decoding reaches train (training/anchors.py). The
target's choices are checked against transformers' own logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import tiny_target

from dflash_jax.config_io import ConfigError, from_dict
from dflash_jax.training.anchors import greedy_slots, sample_anchors, slot_targets
from dflash_jax.training.run_config import TrainSection
from dflash_jax.training.step import block_loss, target_pass

B = 4
T = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("qwen3"), seed=11)


def greedy_text(next_token, vocab: int, seed: int, off_rate: float = 0.3) -> list[int]:
    """T ids: a greedy continuation of 6 random tokens by ``next_token(prefix)``, about ``off_rate``
    of its tokens replaced by random ones (which the continuation then follows), so the text leaves
    the greedy path and comes back to it."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, vocab, 6)]
    while len(ids) < T:
        nxt = next_token(ids)
        ids.append(int(rng.integers(0, vocab)) if rng.random() < off_rate else nxt)
    return ids


@pytest.fixture(scope="module")
def batch_and_reference(tiny):
    """A 2-row batch of partly greedy text and transformers' argmax at every position."""
    hf, _ = tiny
    V = hf.config.vocab_size

    def hf_next(prefix):
        with torch.no_grad():
            return int(hf(torch.tensor([prefix])).logits[0, -1].argmax())

    ids = np.array([greedy_text(hf_next, V, seed) for seed in (0, 1)], np.int64)
    with torch.no_grad():
        ref_logits = hf(torch.tensor(ids)).logits.numpy()
    loss_mask = np.zeros((2, T), np.int32)
    loss_mask[:, 6:] = 1
    batch = {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "positions": jnp.asarray(np.tile(np.arange(T, dtype=np.int32), (2, 1))),
        "segment_ids": jnp.ones((2, T), jnp.int32),
        "loss_mask": jnp.asarray(loss_mask),
    }
    return batch, ref_logits


def test_greedy_slots_match_a_loop():
    rng = np.random.default_rng(0)
    R, A, T_ = 3, 5, 40
    ids = rng.integers(0, 3, (R, T_))
    anchors = np.sort(rng.choice(T_ - B, (R, A), replace=False), axis=1)
    label_pos = anchors[..., None] + np.arange(B - 1)  # a+k-1 for k = 1..B-1
    labels = rng.integers(0, 3, (R, A, B - 1))
    got = np.asarray(greedy_slots(jnp.asarray(ids), jnp.asarray(label_pos), jnp.asarray(labels)))
    want = np.zeros_like(got)
    for r in range(R):
        for j in range(A):
            for k in range(1, B):  # slot k: tokens a+1..a+k-1 equal the labels of slots 1..k-1
                want[r, j, k - 1] = all(ids[r, anchors[r, j] + i] == labels[r, j, i - 1] for i in range(1, k))
    np.testing.assert_array_equal(got, want)
    assert want[..., 0].all() and not want[..., 2].all() and want[..., 2].any()


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_slots_off_the_greedy_path_carry_no_loss(tiny, batch_and_reference, kind):
    """greedy_slots: slot k trains iff it would without the option and each data token
    a+1..a+k-1 is the target's argmax (transformers' logits) after the tokens before it."""
    _, target = tiny
    batch, ref_logits = batch_and_reference
    ref = ref_logits.argmax(-1)
    ids = np.asarray(batch["input_ids"])
    _, hidden = target_pass(target, batch, (0,))
    anchors, valid = sample_anchors(
        jax.random.key(1), batch["loss_mask"], batch["segment_ids"], max_anchors=24
    )
    draft = jnp.zeros((2, 24, B, hidden.shape[-1]))
    trained = {}
    mask, seg = batch["loss_mask"], batch["segment_ids"]
    inputs = (draft, hidden, anchors, valid, mask, seg, target.lm_head_weight())
    for on in (False, True):
        cfg = TrainSection(max_anchors=24, loss=kind, loss_chunk=64, greedy_slots=on)
        loss, extra = block_loss(*inputs, cfg, input_ids=batch["input_ids"])
        assert np.isfinite(float(loss))
        trained[on] = np.asarray(extra["trained"])
    item_mask = np.asarray(slot_targets(anchors, valid, batch["loss_mask"], batch["segment_ids"], B)[1])
    np.testing.assert_array_equal(trained[False], item_mask)
    want = item_mask.copy()
    anchors = np.asarray(anchors)
    for r in range(2):
        for j in range(24):
            a = anchors[r, j]
            for k in range(2, B):
                on_path = all(ids[r, a + i] == ref[r, a + i - 1] for i in range(1, k) if a + i < T)
                want[r, j, k - 1] &= on_path
    np.testing.assert_array_equal(trained[True], want)
    assert want[..., 0].sum() == item_mask[..., 0].sum(), "slot 1 is always on the path"
    assert 0 < want[..., 1:].sum() < item_mask[..., 1:].sum(), "the text leaves the path and returns"


def test_block_loss_without_the_tokens_refuses_greedy_slots():
    cfg = TrainSection(max_anchors=1, loss="ce", greedy_slots=True)
    ones = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="greedy_slots needs the batch's input_ids"):
        block_loss(
            jnp.zeros((1, 1, 2, 2)),
            jnp.ones((1, 4, 2)),
            jnp.array([[1]]),
            jnp.array([[True]]),
            ones,
            ones,
            jnp.ones((2, 3)),
            cfg,
        )


def test_micro_batches_equal_the_full_batch_on_the_greedy_path():
    """greedy_slots with train.micro_batches: the normaliser counts the slots on the path over the
    whole batch, so the update is the full batch's."""
    import optax
    from test_micro_batches import _setup

    from dflash_jax.drafter.api import get_params, init_drafter
    from dflash_jax.training.step import apply_train_step, drafter_loss

    target, dc = _setup()

    @jax.jit
    def logits(x):
        return target(x, return_logits=True).logits

    rows = []
    for seed in range(4):

        def nxt(prefix):
            padded = np.zeros((1, T), np.int32)
            padded[0, : len(prefix)] = prefix
            return int(np.asarray(logits(jnp.asarray(padded)))[0, len(prefix) - 1].argmax())

        rows.append(greedy_text(nxt, 250, seed))
    batch = {
        "input_ids": jnp.asarray(rows, jnp.int32),
        "positions": jnp.asarray(np.tile(np.arange(T, dtype=np.int32), (4, 1))),
        "segment_ids": jnp.ones((4, T), jnp.int32),
        "loss_mask": jnp.asarray(np.tile((np.arange(T) >= 6).astype(np.int32), (4, 1))),
    }
    out = {}
    for on, m in ((False, 1), (True, 1), (True, 2)):
        cfg = TrainSection(max_anchors=40, loss_chunk=16, micro_batches=m, greedy_slots=on, loss="kl")
        drafter = init_drafter(dc, target, 3)
        optimizer = nnx.Optimizer(drafter, optax.sgd(1.0), wrt=nnx.Param)
        step = nnx.jit(lambda d, o, t, b, k, cfg=cfg: apply_train_step(d, o, t, b, k, cfg, 1.0))
        metrics = jax.tree.map(np.asarray, step(drafter, optimizer, target, batch, jax.random.key(7)))
        out[(on, m)] = (metrics, get_params(drafter))
    # the option acts on this text: fewer slots carry the loss
    denominators = [
        float(
            drafter_loss(
                init_drafter(dc, target, 3),
                target,
                batch,
                jax.random.key(7),
                TrainSection(max_anchors=40, loss="kl", greedy_slots=on),
            )[1]["loss_denominator"]
        )
        for on in (False, True)
    ]
    assert 0 < denominators[1] < denominators[0]
    assert out[(True, 1)][0]["loss"] != out[(False, 1)][0]["loss"]
    (want, want_params), (got, got_params) = out[(True, 1)], out[(True, 2)]
    for k in ("loss", "streak", "slot_acc"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(got_params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6, rtol=1e-4)


def test_a_non_boolean_greedy_slots_is_refused_by_name():
    with pytest.raises(ConfigError, match="greedy_slots"):
        from_dict(TrainSection, {"greedy_slots": "sometimes"}, "train")
