"""Invariants 2, 5 and 6 of the training step, checked against transformers' own logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import prompt_ids, tiny_target

import dflash_jax
from dflash_jax.training.anchors import anchor_candidates, sample_anchors, slot_targets
from dflash_jax.training.loss import (
    chunked_token_loss,
    default_gamma,
    even_chunks,
    slot_weights,
    target_argmax,
)
from dflash_jax.training.run_config import TrainSection
from dflash_jax.training.step import block_loss, drafter_loss, target_pass

B = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("qwen3"), seed=11)


def packed_batch(T=192, seed=0):
    ids = prompt_ids(T, 512, seed=seed, batch=2)
    seg = np.ones((2, T), np.int32)
    seg[0, 100:] = 2  # two documents in row 0
    pos = np.where(seg[0] == 1, np.arange(T), np.arange(T) - 100)
    positions = np.stack([pos, np.arange(T)]).astype(np.int32)
    loss_mask = np.zeros((2, T), np.int32)
    loss_mask[0, 20:90] = 1
    loss_mask[0, 130:190] = 1
    loss_mask[1, 40:] = 1
    return {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "positions": jnp.asarray(positions),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray(loss_mask),
    }


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_labels_are_the_targets_own_next_token_logits(tiny, kind):
    """Invariant 2: slot k of the block at anchor p is labelled by the target's logits at p+k-1
    (the labels the loss actually uses, for both loss kinds)."""
    hf, target = tiny
    batch = packed_batch()
    cfg = TrainSection(max_anchors=12, loss=kind, loss_chunk=64)
    _, hidden = target_pass(target, batch, (0, 2))
    anchors, valid = sample_anchors(
        jax.random.key(0), batch["loss_mask"], batch["segment_ids"], max_anchors=12
    )
    draft = jnp.zeros((2, 12, B, hidden.shape[-1]))
    _, extra = block_loss(
        draft, hidden, anchors, valid, batch["loss_mask"], batch["segment_ids"], target.lm_head_weight(), cfg
    )
    labels = np.asarray(extra["labels"])
    trained = np.asarray(slot_targets(anchors, valid, batch["loss_mask"], batch["segment_ids"], B)[1])

    # Reference: transformers on each document separately (its true final logits).
    ids = np.asarray(batch["input_ids"])
    docs = {(0, 1): (0, 100), (0, 2): (100, 192), (1, 1): (0, 192)}
    ref_logits = {}
    for (row, seg), (a, b) in docs.items():
        with torch.no_grad():
            ref_logits[(row, seg)] = hf(torch.tensor(ids[row : row + 1, a:b])).logits[0].numpy()
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    seg_ids = np.asarray(batch["segment_ids"])
    checked = 0
    for r in range(2):
        for j in range(12):
            if not valid[r, j]:
                continue
            p = anchors[r, j]
            s = seg_ids[r, p]
            start = docs[(r, s)][0]
            for k in np.nonzero(trained[r, j])[0] + 1:  # the slots the loss trains
                want = int(np.argmax(ref_logits[(r, s)][p + k - 1 - start]))
                assert labels[r, j, k - 1] == want, (r, j, k)
                checked += 1
    assert checked >= 12 * (B - 1)


@pytest.mark.parametrize("target_dtype, want", [(jnp.float32, 1), (jnp.bfloat16, 0)])
def test_labels_come_from_the_targets_own_dtype_not_the_drafters(target_dtype, want):
    """Invariant 2 with a bf16 drafter: the ce label is the argmax of the target's logits as the
    target computes them. Logits 1 and 1 + 2^-10 are a tie once rounded to bf16 (argmax 0), but an
    fp32 target's own output picks id 1."""
    cfg = TrainSection(max_anchors=1, loss="ce", compute_dtype="bfloat16")
    hidden = jnp.tile(jnp.array([1.0, 0.0], jnp.float32), (1, 4, 1))  # [R=1, T=4, D=2]
    lm_head = jnp.array([[1.0, 1.0 + 2.0**-10, 0.0], [0.0, 0.0, 1.0]], jnp.float32).astype(target_dtype)
    ones = jnp.ones((1, 4), jnp.int32)
    _, extra = block_loss(
        jnp.zeros((1, 1, 2, 2)), hidden, jnp.array([[1]]), jnp.array([[True]]), ones, ones, lm_head, cfg
    )
    assert int(extra["labels"][0, 0, 0]) == want


def test_anchors_are_reply_positions_whose_next_token_is_trained():
    """Invariant 5: an anchor p has loss_mask[p] and loss_mask[p+1] in the same document; a block
    need not fit in the document (its slots past the reply simply do not train)."""
    batch = packed_batch()
    cand = np.asarray(anchor_candidates(batch["loss_mask"], batch["segment_ids"]))
    seg = np.asarray(batch["segment_ids"])
    lm = np.asarray(batch["loss_mask"])
    want = np.zeros_like(cand)
    want[:, :-1] = (lm[:, :-1] == 1) & (lm[:, 1:] == 1) & (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] != 0)
    np.testing.assert_array_equal(cand, want)
    assert cand[0, 88] and not cand[0, 89], "the last reply token but one starts a block, the last does not"
    assert cand[1, 190] and not cand[1, 191], "nor does the last position of the row"
    anchors, valid = sample_anchors(
        jax.random.key(3), batch["loss_mask"], batch["segment_ids"], max_anchors=400
    )
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    for r in range(2):
        real = anchors[r][valid[r]]
        assert (np.diff(real) > 0).all(), "anchors sorted and distinct"
        assert cand[r, real].all()
        assert len(real) == cand[r].sum(), "asking for more anchors than candidates takes them all"


def test_slot_zero_carries_no_loss_and_slot_one_does(tiny):
    """Invariant 5: slot 0 (the real token at the anchor) is never in the loss."""
    _, target = tiny
    batch = packed_batch()
    cfg = TrainSection(max_anchors=8)
    _, hidden = target_pass(target, batch, (0, 2))
    anchors, valid = sample_anchors(
        jax.random.key(1), batch["loss_mask"], batch["segment_ids"], max_anchors=8
    )
    draft = jax.random.normal(jax.random.key(2), (2, 8, B, hidden.shape[-1]))
    W = target.lm_head_weight()

    def loss(d):
        return block_loss(d, hidden, anchors, valid, batch["loss_mask"], batch["segment_ids"], W, cfg)[0]

    grad = np.asarray(jax.grad(loss)(draft))
    assert np.all(grad[:, :, 0] == 0), "slot 0 must not influence the loss"
    assert np.abs(grad[:, :, 1][np.asarray(valid)]).max() > 0
    assert np.all(grad[~np.asarray(valid)] == 0), "padded anchors must not influence the loss"


def test_slot_weights_formula_and_gamma_defaults():
    """Invariant 6: w_k = exp(-(k-1)/gamma), w_0 = 0; gamma 7/5/4 for B = 16/10/8."""
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    for bs in (16, 10, 8):
        w = np.asarray(slot_weights(bs))
        g = default_gamma(bs)
        assert w[0] == 0
        np.testing.assert_allclose(w[1:], np.exp(-(np.arange(1, bs) - 1) / g), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(slot_weights(4, gamma=2.0))[1:], np.exp(-np.arange(3) / 2.0), rtol=1e-6
    )
    with pytest.raises(ValueError, match="gamma"):
        slot_weights(8, gamma=0.0)


def test_feature_noise_never_touches_labels(tiny):
    """Noise augments the drafter's input features only; labels come from the clean target."""
    _, target = tiny
    batch = packed_batch()
    dcfg = dflash_jax.DrafterConfig.for_target(target.config, num_layers=1, mask_token_id=3, block_size=B)
    drafter = dflash_jax.init_drafter(dcfg, target, 0)
    base = TrainSection(max_anchors=8)
    noisy = TrainSection(max_anchors=8, feature_noise_std=5.0)

    def labels_and_loss(cfg):
        loss, m = drafter_loss(drafter, target, batch, jax.random.key(4), cfg, with_labels=True)
        return float(loss), np.asarray(m["labels"])

    loss_clean, lab_clean = labels_and_loss(base)
    loss_noisy, lab_noisy = labels_and_loss(noisy)
    np.testing.assert_array_equal(lab_clean, lab_noisy)
    assert loss_clean != loss_noisy, "noise must reach the drafter's features"


def test_loss_chunks_split_evenly():
    """As few chunks as the limit allows, all one size, fewer padded items than chunks."""
    assert even_chunks(3840, 512) == (8, 480)  # the demo's slots: no padded rows
    rng = np.random.default_rng(0)
    for n, limit in [(1, 1), (5, 1024), (7, 3), (1537, 512), *rng.integers(1, 5000, (50, 2)).tolist()]:
        count, size = even_chunks(n, limit)
        assert count == -(-n // limit) and size <= limit and 0 <= count * size - n < count, (n, limit)
    with pytest.raises(ValueError, match="chunk >= 1"):
        even_chunks(10, 0)


def test_chunked_loss_matches_dense_and_fits_memory():
    """The chunked loss equals a dense reference, and at V=151936 never holds [N, V] fp32 at once."""
    key = jax.random.key(0)
    N, D, V = 301, 32, 1000  # 5 chunks of 61: the last item padded
    dh, th = jax.random.normal(key, (2, N, D))
    W = jax.random.normal(jax.random.key(1), (D, V)) * 0.3
    for kind in ("ce", "kl"):
        loss, correct, label, label_ce = chunked_token_loss(dh, th, W, kind=kind, chunk=64)
        t_logp = jax.nn.log_softmax(th @ W)
        d_logp = jax.nn.log_softmax(dh @ W)
        lab = jnp.argmax(t_logp, -1)
        ce = -jnp.take_along_axis(d_logp, lab[:, None], -1)[:, 0]
        ref = ce if kind == "ce" else jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), -1)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(ref), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(label), np.asarray(lab))
        # the cross-entropy on the label (D-PACE's estimate), the KL's too
        np.testing.assert_allclose(np.asarray(label_ce), np.asarray(ce), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(correct), np.asarray(jnp.argmax(d_logp, -1) == lab))
    # kl with labels given (a draft vocabulary's): correct and label_ce refer to them, the loss not
    given = (lab + 1) % V
    loss_g, correct_g, label_g, ce_g = chunked_token_loss(dh, th, W, kind="kl", chunk=64, labels=given)
    np.testing.assert_allclose(np.asarray(loss_g), np.asarray(loss), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(label_g), np.asarray(given))
    np.testing.assert_array_equal(np.asarray(correct_g), np.asarray(jnp.argmax(d_logp, -1) == given))
    want_ce = -jnp.take_along_axis(d_logp, given[:, None], -1)[:, 0]
    np.testing.assert_allclose(np.asarray(ce_g), np.asarray(want_ce), rtol=1e-5, atol=1e-5)

    # Gradients w.r.t. the drafter's hidden state (taken in the forward pass, fused) equal plain
    # autodiff of the dense loss, with a logits function that scales and soft-caps like z-lab's;
    # items carry different cotangents (weights), N is not a multiple of the chunk.
    weights = jax.random.uniform(jax.random.key(2), (N,))

    def draft_logits(h):
        return jnp.tanh(1.7 * (h @ W) / 30.0) * 30.0

    for kind in ("ce", "kl"):

        def fused(d, kind=kind):
            loss = chunked_token_loss(d, th, W, draft_logits=draft_logits, kind=kind, chunk=64)[0]
            return jnp.sum(loss * weights)

        def dense(d, kind=kind):
            t_logp = jax.nn.log_softmax(th @ W)
            d_logp = jax.nn.log_softmax(draft_logits(d))
            if kind == "ce":
                loss = -jnp.take_along_axis(d_logp, jnp.argmax(t_logp, -1)[:, None], -1)[:, 0]
            else:
                loss = jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), -1)
            return jnp.sum(loss * weights)

        (v_f, g_f), (v_d, g_d) = jax.value_and_grad(fused)(dh), jax.value_and_grad(dense)(dh)
        np.testing.assert_allclose(float(v_f), float(v_d), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(g_f), np.asarray(g_d), rtol=1e-4, atol=1e-6)

    # Memory: A*B slots of a Qwen3-sized vocabulary; compiled temp must stay far below [N, V] fp32.
    N, D, V = 4096, 256, 151936
    args = (
        jax.ShapeDtypeStruct((N, D), jnp.float32),
        jax.ShapeDtypeStruct((N, D), jnp.float32),
        jax.ShapeDtypeStruct((D, V), jnp.float32),
    )

    def ce(d, t, w):  # the training path: per-position argmax labels, then the chunked CE
        labels = target_argmax(t, w, chunk=256)
        return jnp.mean(chunked_token_loss(d, None, w, chunk=256, labels=labels)[0])

    def kl(d, t, w):
        return jnp.mean(chunked_token_loss(d, t, w, kind="kl", chunk=256)[0])

    dense, one_chunk = N * V * 4, 256 * V * 4
    for f in (ce, kl):
        compiled = jax.jit(jax.value_and_grad(f)).lower(*args).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        # A few chunk-sized [256, V] buffers (draft and target logits, dlogits, the lm_head's
        # transpose), never the 16 chunks of the dense [N, V] logits.
        assert temp < 5 * one_chunk, (
            f"{f.__name__}: temp {temp / 2**20:.0f} MiB vs one chunk {one_chunk / 2**20:.0f} MiB, "
            f"dense logits {dense / 2**20:.0f} MiB"
        )
