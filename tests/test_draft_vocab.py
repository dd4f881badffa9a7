"""Reduced draft vocabulary (invariant 9, ``drafter.draft_vocab_size``): choice, loss, decoding,
export/import and resume.

References: the loss and its metrics against a NumPy transcription of the rule (under ``ce`` and
``kl`` alike a slot whose label, the target's argmax over all V, is outside the set leaves the loss
and the normaliser and scores wrong; ``kl`` trains the rest on the target's softmax restricted to
the set and renormalised; D-PACE weighs by exp(-CE) on the label), decoding against plain greedy decoding of the target, and the speculators layout
against speculators 0.9.0 itself where it is installed.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import save_hf_model

import dflash_jax
from convert import drafter_to_hf, hf_to_drafter
from convert.speculators import draft_vocab_of, vocab_mappings
from convert.zlab_drafter import WEIGHTS_FILE, flatten, unflatten
from dflash_jax.drafter.api import get_params, init_drafter, set_draft_vocab, set_params
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.training.anchors import count_labels, label_positions, sample_anchors, slot_targets
from dflash_jax.training.draft_vocab import choose_draft_vocab
from dflash_jax.training.loss import default_gamma
from dflash_jax.training.run_config import TrainSection
from dflash_jax.training.step import drafter_loss, target_pass

B = 8
N = 96  # of the tiny target's 512 ids


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_vocab"), seed=5)


@pytest.fixture(scope="module")
def target(target_dir):
    return dflash_jax.load_target(target_dir)


def _batch(R=4, T=48, vocab=512, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, size=(R, T)).astype(np.int32)
    seg = np.ones((R, T), np.int32)
    seg[:, T // 2 :] = 2
    seg[R - 1, T - 5 :] = 0
    positions = np.where(seg == 2, np.arange(T) - T // 2, np.arange(T)).astype(np.int32)
    positions[seg == 0] = 0
    mask = np.zeros((R, T), np.int32)
    mask[:, 5:14] = mask[:, 17:22] = 1
    mask[:, T // 2 + 4 : T - 6] = 1
    return {
        k: jnp.asarray(v)
        for k, v in dict(input_ids=ids, positions=positions, segment_ids=seg, loss_mask=mask).items()
    }


def _drafter(target, ids=None, seed=0, **kw):
    cfg = DrafterConfig.for_target(
        target.config, num_layers=1, mask_token_id=7, block_size=B, draft_vocab_size=N, **kw
    )
    drafter = init_drafter(cfg, target, seed)
    if ids is None:
        ids = np.sort(np.random.default_rng(seed + 1).choice(target.config.vocab_size, N, replace=False))
    return set_draft_vocab(drafter, ids)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# --------------------------------------------------------------------------- choice


def test_chosen_set_holds_the_stop_ids_and_the_most_frequent_labels():
    counts = np.zeros(50, np.int64)
    counts[[3, 9, 11, 20, 40]] = [5, 50, 7, 7, 1]
    ids = choose_draft_vocab(counts, 4, always=[49])
    assert ids.tolist() == [9, 11, 20, 49]  # 49 (never a label) always in; 11/20 tie beats 3
    assert ids.dtype == np.int32
    # more ids than distinct labels: filled by id order, still distinct and ascending
    ids = choose_draft_vocab(counts, 8, always=[0])
    assert (
        len(set(ids.tolist())) == 8
        and np.all(np.diff(ids) > 0)
        and {0, 3, 9, 11, 20, 40} <= set(ids.tolist())
    )
    with pytest.raises(ValueError, match="stop ids"):
        choose_draft_vocab(counts, 4, always=[50])
    with pytest.raises(ValueError, match="draft_vocab_size=1"):
        choose_draft_vocab(counts, 1, always=[1, 2])


def test_labels_are_counted_where_a_block_can_train_them():
    # row: doc 1 = [user 0..2][reply 3..5], doc 2 = [user 6,7][reply 8,9], pad 10
    seg = np.array([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0]])
    mask = np.array([[0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0]])
    # label p is the next token: trainable when p+1 is in the reply of p's document
    assert np.flatnonzero(label_positions(mask, seg)[0]).tolist() == [2, 3, 4, 7, 8]
    labels = np.array([[1, 1, 4, 4, 5, 9, 9, 6, 6, 9, 9]])
    counts = count_labels(labels, mask, seg, 10)
    assert counts.tolist() == [0, 0, 0, 0, 2, 1, 2, 0, 0, 0]
    # the anchors' own label positions all lie in that set
    anchors, valid = sample_anchors(jax.random.key(0), jnp.asarray(mask), jnp.asarray(seg), max_anchors=4)
    pos, trained = slot_targets(anchors, valid, jnp.asarray(mask), jnp.asarray(seg), 4)
    allowed = set(np.flatnonzero(label_positions(mask, seg)[0]).tolist())
    assert set(np.asarray(pos)[np.asarray(trained)].tolist()) <= allowed


# --------------------------------------------------------------------------- loss


def _dpace_numpy(ce, trained, alpha):
    """D-PACE weights from the definition, block by block: s_k = (1-alpha) exp(-CE_k) + alpha on
    trained slots (1 elsewhere), P_k = prod_{i<=k} s_i, w_k = sum of P_m over trained m >= k."""
    w = np.zeros_like(ce)
    for block in np.ndindex(ce.shape[:-1]):
        s = np.where(trained[block], (1 - alpha) * np.exp(-ce[block]) + alpha, 1.0)
        reach = np.cumprod(s) * trained[block]
        for k in np.flatnonzero(trained[block]):
            w[block][k] = reach[k:].sum()
    return w


def _reference_slots(t_logits, d_logits, ids, item, valid, cfg):
    """NumPy transcription of the loss and metrics over a draft vocabulary ``ids`` [N] ascending:
    t_logits [R,A,S,V] the target's, d_logits [R,A,S,N] the drafter's, item [R,A,S] the slots the
    block mask trains, valid [R,A]. A slot whose full-vocabulary argmax is outside ``ids`` leaves
    loss and normaliser under both losses; kl compares the target's softmax restricted to ``ids``
    and renormalised; D-PACE weighs by exp(-CE) on the argmax under both."""
    label = t_logits.argmax(-1)  # the target's choice over all V
    index = np.searchsorted(ids, label)
    inside = (index < len(ids)) & (ids[np.minimum(index, len(ids) - 1)] == label)
    index = np.minimum(index, len(ids) - 1)
    d_logp = _log_softmax(d_logits)
    ce = -np.take_along_axis(d_logp, index[..., None], -1)[..., 0]
    if cfg.loss == "ce":
        loss = ce
    else:
        t_logp = _log_softmax(t_logits[..., ids])
        loss = np.sum(np.exp(t_logp) * (t_logp - d_logp), -1)
    trained = item & inside
    if cfg.loss_weighting == "dpace":
        value = np.sum(_dpace_numpy(ce, trained, cfg.dpace_alpha) * loss) / max(trained.sum(), 1)
    else:
        w = np.exp(-np.arange(d_logits.shape[2]) / cfg.gamma) * trained
        value = np.sum(w * loss) / w.sum()
    right = (ids[d_logits.argmax(-1)] == label) & item  # a target id, outside the set never right
    streak = 1 + np.cumprod(right, axis=-1).sum(-1)
    return {
        "loss": value,
        "trained": trained,
        "labels": label,
        "label_coverage": trained.sum() / item.sum(),
        "slot_acc": right.sum((0, 1)) / np.maximum(item.sum((0, 1)), 1),
        "streak": streak[valid].mean(),
        "ce": ce,
        "kl_or_ce": loss,
    }


def _reference_loss(target, drafter, batch, key, cfg, kind):
    """The drafter's and target's outputs for the blocks the step draws, then ``_reference_slots``."""
    ids = np.asarray(drafter.draft_vocab[...])
    k_anchor, _ = jax.random.split(key)
    anchors, valid = sample_anchors(
        k_anchor, batch["loss_mask"], batch["segment_ids"], max_anchors=cfg.max_anchors
    )
    features, hidden = target_pass(target, batch, drafter.config.target_layer_ids)
    embeds = drafter.train_block_embeds(target, batch["input_ids"], anchors)
    out = drafter.forward_train(features, batch["positions"], batch["segment_ids"], anchors, valid, embeds)
    label_pos, item = slot_targets(anchors, valid, batch["loss_mask"], batch["segment_ids"], B)
    lm = np.asarray(target.lm_head_weight(), np.float64)
    d_logits = np.asarray(out[:, :, 1:], np.float64) @ lm[:, ids]  # [R,A,B-1,N]
    h = np.asarray(hidden, np.float64)
    pos = np.asarray(label_pos)
    t_logits = np.stack([h[r][pos[r]] for r in range(h.shape[0])]) @ lm  # [R,A,B-1,V]
    cfg = cfg if cfg.gamma is not None else dataclasses.replace(cfg, gamma=default_gamma(B))
    ref = _reference_slots(t_logits, d_logits, ids, np.asarray(item), np.asarray(valid), cfg)
    return ref["loss"], ref["trained"]


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_reduced_vocab_loss_matches_numpy(target, kind, weighting):
    drafter = _drafter(target)
    batch = _batch()
    cfg = TrainSection(max_anchors=6, loss=kind, loss_weighting=weighting, loss_chunk=32)
    key = jax.random.key(3)
    loss, metrics = drafter_loss(drafter, target, batch, key, cfg)
    want, trained = _reference_loss(target, drafter, batch, key, cfg, kind)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    # a random set of 96 ids holds only some labels: some slots left out, some kept (kl too)
    assert 0 < trained.sum() < np.asarray(metrics["slot_count"]).sum()
    assert int(metrics["in_vocab_count"]) == trained.sum()


def _slot_problem(seed=0, R=2, T=20, D=16, V=64, n=20, S=4):
    """Random target hidden states and lm_head, hand-placed blocks, a drafter hidden state near
    the target's at each slot's label position (so its argmax is often the target's in-set
    choice), and a random draft vocabulary of n ids."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(R, T, D)).astype(np.float32)
    lm_head = (3 * rng.normal(size=(D, V)) / np.sqrt(D)).astype(np.float32)
    seg = np.ones((R, T), np.int32)
    seg[0, 11:] = 2
    seg[1, T - 2 :] = 0
    mask = np.ones((R, T), np.int32)
    mask[0, [0, 6, 11]] = mask[1, [0, 1, 9]] = 0
    anchors = np.array([[1, 3, 8, 12, 16, 19], [2, 4, 10, 13, 15, 19]], np.int32)
    valid = np.ones(anchors.shape, bool)
    valid[1, -1] = False
    # slot k of the block at a (k = 1..S-1): trained iff a+1..a+k lie in the row, in a's document
    # and in the loss mask; labelled at a+k-1
    item = np.zeros((R, anchors.shape[1], S - 1), bool)
    for r, j in np.ndindex(anchors.shape):
        a = anchors[r, j]
        for k in range(1, S):
            span = range(a + 1, a + k + 1)
            item[r, j, k - 1] = valid[r, j] and all(
                p < T and mask[r, p] and seg[r, p] == seg[r, a] != 0 for p in span
            )
    label_pos = np.minimum(anchors[..., None] + np.arange(S - 1), T - 1)  # a+k-1
    target_h = np.stack([hidden[r][label_pos[r]] for r in range(R)])  # [R,A,S-1,D]
    draft = np.zeros((R, anchors.shape[1], S, D), np.float32)
    draft[:, :, 1:] = target_h + 0.4 * rng.normal(size=target_h.shape)
    ids = np.sort(rng.choice(V, n, replace=False)).astype(np.int32)
    arrays = dict(hidden=hidden, lm_head=lm_head, seg=seg, mask=mask, anchors=anchors, valid=valid)
    return arrays, item, draft, target_h, ids


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("cached", [False, True])
def test_out_of_set_labels_leave_both_losses_and_count_wrong(kind, weighting, cached):
    """Invariant 9 under both losses, against ``_reference_slots``: a slot whose target argmax
    over the whole vocabulary is outside the draft set is not trained (loss and normaliser),
    label_coverage counts it, slot_acc and streak score it wrong even where the drafter picks the
    target's best in-set id, and D-PACE weighs by exp(-CE) on the argmax (under kl, not
    exp(-KL)). ``cached``: the labels come per position with the batch, as the feature cache
    gives them, and the result is the same."""
    from dflash_jax.training.step import block_loss

    x, item, draft, target_h, ids = _slot_problem()
    cfg = TrainSection(loss=kind, loss_weighting=weighting, loss_chunk=16, gamma=2.0)
    lm = x["lm_head"].astype(np.float64)
    position_labels = (
        jnp.asarray((x["hidden"].astype(np.float64) @ lm).argmax(-1), jnp.int32) if cached else None
    )
    loss, extra = block_loss(
        jnp.asarray(draft),
        jnp.asarray(x["hidden"]),
        jnp.asarray(x["anchors"]),
        jnp.asarray(x["valid"]),
        jnp.asarray(x["mask"]),
        jnp.asarray(x["seg"]),
        jnp.asarray(x["lm_head"]),
        cfg,
        draft_logits=lambda h: h @ jnp.asarray(x["lm_head"])[:, ids],
        position_labels=position_labels,
        draft_vocab=jnp.asarray(ids),
    )
    t_logits = target_h.astype(np.float64) @ lm
    d_logits = draft[:, :, 1:].astype(np.float64) @ lm[:, ids]
    want = _reference_slots(t_logits, d_logits, ids, item, x["valid"], cfg)
    # the problem has both kinds of slot, and slots that the old rule (the drafter's argmax against
    # the target's in-set one) would have scored right although their label is outside the set
    assert 0 < want["trained"].sum() < item.sum()
    in_set_choice = t_logits[..., ids].argmax(-1) == d_logits.argmax(-1)
    assert np.any(in_set_choice & item & ~want["trained"])

    np.testing.assert_allclose(float(loss), want["loss"], rtol=2e-5)
    assert np.array_equal(np.asarray(extra["trained"]), want["trained"])
    assert np.array_equal(np.asarray(extra["labels"])[item], want["labels"][item])
    coverage = int(extra["in_vocab_count"]) / int(np.sum(extra["slot_count"]))
    np.testing.assert_allclose(coverage, want["label_coverage"], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(extra["slot_acc"]), want["slot_acc"], rtol=1e-6)
    np.testing.assert_allclose(float(extra["streak"]), want["streak"], rtol=1e-6)
    if kind == "kl" and weighting == "dpace":  # exp(-KL) weights would give another loss
        w = _dpace_numpy(want["kl_or_ce"], want["trained"], cfg.dpace_alpha)
        by_kl = np.sum(w * want["kl_or_ce"]) / want["trained"].sum()
        assert abs(by_kl - want["loss"]) > 1e-3 * want["loss"]


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_label_coverage_metric(target, kind):
    """label_coverage: the fraction of trained slots whose label (the target's argmax over all V,
    under kl too) is in the set (1 when the set holds every label); the update leaves the set
    itself unchanged (data, not a parameter)."""
    from flax import nnx

    from dflash_jax.training.step import apply_train_step, make_optimizer

    batch, key = _batch(), jax.random.key(3)
    cfg = TrainSection(max_anchors=6, loss_chunk=32, loss=kind)
    drafter = _drafter(target)
    before = np.asarray(drafter.draft_vocab[...]).copy()
    _, in_set = _reference_loss(target, drafter, batch, key, cfg, kind)
    all_slots = int(np.asarray(drafter_loss(drafter, target, batch, key, cfg)[1]["slot_count"]).sum())
    opt = nnx.Optimizer(drafter, make_optimizer(cfg), wrt=nnx.Param)
    metrics = apply_train_step(drafter, opt, target, batch, key, cfg, 1e-3)
    assert 0 < float(metrics["label_coverage"]) < 1
    np.testing.assert_allclose(float(metrics["label_coverage"]), in_set.sum() / all_slots, rtol=1e-6)
    assert np.array_equal(np.asarray(drafter.draft_vocab[...]), before)

    _, m = drafter_loss(drafter, target, batch, key, cfg, with_labels=True)
    counts = np.bincount(np.asarray(m["labels"]).ravel(), minlength=512)
    ids = choose_draft_vocab(counts, np.count_nonzero(counts) + 1, always=[7])
    every = init_drafter(drafter.config.replace(draft_vocab_size=len(ids)), target, 0)
    set_draft_vocab(every, ids)
    opt = nnx.Optimizer(every, make_optimizer(cfg), wrt=nnx.Param)
    assert float(apply_train_step(every, opt, target, batch, key, cfg, 0.0)["label_coverage"]) == 1.0


@pytest.mark.parametrize("kind, weighting", [("ce", "decay"), ("kl", "dpace")])
def test_micro_batches_equal_the_full_batch_with_a_draft_vocab(target, kind, weighting):
    """The normaliser (trained, in-set slots over the whole batch) does not depend on the split."""
    from flax import nnx

    from dflash_jax.training.step import apply_train_step, make_optimizer

    batch, key = _batch(), jax.random.key(4)
    out = {}
    for m in (1, 2):
        cfg = TrainSection(max_anchors=6, loss_chunk=32, micro_batches=m, loss=kind, loss_weighting=weighting)
        drafter = _drafter(target)
        opt = nnx.Optimizer(drafter, make_optimizer(cfg), wrt=nnx.Param)
        metrics = apply_train_step(drafter, opt, target, batch, key, cfg, 1e-2)
        out[m] = (
            float(metrics["loss"]),
            float(metrics["label_coverage"]),
            flatten(jax.device_get(get_params(drafter))),
        )
    assert out[1][0] == pytest.approx(out[2][0], rel=1e-5) and out[1][1] == pytest.approx(out[2][1], rel=1e-6)
    # Adam's first step is lr * g / (|g| + eps): a weight whose gradient is near eps (1e-8) moves by
    # a visibly different fraction of lr for float-order differences of g (kl/dpace: gradients of the
    # two splits agree to 1e-8, some are 3e-9), hence atol 1% of lr there
    atol = 2e-5 if kind == "ce" else 1e-4
    for k, v in out[1][2].items():
        np.testing.assert_allclose(out[2][2][k], v, rtol=1e-4, atol=atol, err_msg=k)


# --------------------------------------------------------------------------- decoding


def test_speculative_decoding_with_a_draft_vocab_is_lossless(target):
    from dflash_jax.decoding.generate import generate
    from dflash_jax.decoding.speculative import speculative_generate

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 7, 13)]
    plain = generate(target, prompts, max_new_tokens=16, batch_size=2)
    # the set holds the target's own greedy tokens, so the drafter can hit some of them
    ids = choose_draft_vocab(np.bincount(np.concatenate(plain), minlength=512), N, always=[7])
    drafter = _drafter(target, ids=ids, seed=2)
    ours = speculative_generate(target, drafter, prompts, max_new_tokens=16, batch_size=2)
    assert [o.output_ids for o in ours] == plain
    # drafts are target ids of the set (mapped back from draft indices), never raw indices
    logits = drafter.logits(jnp.ones((1, target.config.hidden_size)), target)
    assert logits.shape == (1, N)
    assert int(drafter.to_target_ids(jnp.argmax(logits, -1))[0]) in set(ids.tolist())


# --------------------------------------------------------------------------- export / import


def _run_with(tmp_path, drafter, target_dir):
    import optax
    from flax import nnx

    from dflash_jax.checkpoint import Checkpointer

    opt = nnx.Optimizer(drafter, optax.adamw(1e-3), wrt=nnx.Param)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    config = {"drafter_config": drafter.config.to_dict(), "target": {"path": str(target_dir)}}
    ckpt.save(3, drafter, opt, {"epoch": 0}, config, force=True)
    ckpt.close()
    return tmp_path / "run"


def test_speculators_export_import_round_trip(target, target_dir, tmp_path):
    from safetensors.numpy import load_file

    from dflash_jax.checkpoint import read_checkpoint

    drafter = _drafter(target, seed=4)
    rng = np.random.default_rng(1)
    params = {
        k: np.asarray(v) + (0 if k == "draft_vocab" else 0.1 * rng.normal(size=v.shape).astype(np.float32))
        for k, v in flatten(get_params(drafter)).items()
    }
    set_params(drafter, unflatten(params))
    run = _run_with(tmp_path, drafter, target_dir)
    # the checkpoint keeps the set with the parameters
    config, stored, _ = read_checkpoint(run)
    assert config.draft_vocab_size == N and np.array_equal(stored["draft_vocab"], drafter.draft_vocab[...])

    with pytest.raises(ValueError, match="draft_vocab_size=96"):
        drafter_to_hf.export(run, tmp_path / "zlab", dtype="float32")
    assert not (tmp_path / "zlab").exists()

    spec = drafter_to_hf.export(run, tmp_path / "spec", fmt="speculators", dtype="float32")
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["draft_vocab_size"] == N and cfg["transformer_layer_config"]["vocab_size"] == 512
    tensors = load_file(spec / WEIGHTS_FILE)
    ids = np.asarray(drafter.draft_vocab[...])
    assert tensors["t2d"].dtype == np.bool_ and tensors["t2d"].shape == (512,) and tensors["t2d"].sum() == N
    assert tensors["d2t"].dtype == np.int64 and np.array_equal(np.arange(N) + tensors["d2t"], ids)
    np.testing.assert_array_equal(tensors["lm_head.weight"], np.asarray(target.lm_head_weight()).T[ids])

    imp = tmp_path / "imp"
    assert hf_to_drafter.main(["--hf", str(spec), "--out", str(imp)]) == 0
    config2, params2, _ = read_checkpoint(imp)
    assert config2 == drafter.config
    a, b = flatten(jax.device_get(get_params(drafter))), flatten(params2)
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    # and back out again: the same t2d/d2t
    again = load_file(
        drafter_to_hf.export(imp, tmp_path / "again", fmt="speculators", dtype="float32") / WEIGHTS_FILE
    )
    assert all(np.array_equal(again[k], tensors[k]) for k in ("t2d", "d2t"))


def test_inconsistent_vocab_mappings_are_refused():
    m = vocab_mappings(np.array([1, 4, 9]), 12)
    assert draft_vocab_of(m["t2d"], m["d2t"], draft_vocab_size=3, vocab_size=12).tolist() == [1, 4, 9]
    t2d = m["t2d"].copy()
    t2d[5] = True
    with pytest.raises(ValueError, match="t2d does not mark"):
        draft_vocab_of(t2d, m["d2t"], draft_vocab_size=3, vocab_size=12)
    with pytest.raises(ValueError, match="vocab_size=13"):
        draft_vocab_of(m["t2d"], m["d2t"], draft_vocab_size=3, vocab_size=13)


def test_speculators_loads_the_export(target, target_dir, tmp_path):
    """speculators 0.9.0 itself: no missing keys, and its draft tokens for one block equal ours.

    scripts/setup.sh installs it --no-deps (its requirements pin transformers <= 5.19) with the
    few packages its import chain needs."""
    pytest.importorskip("speculators", reason="speculators 0.9.0 is installed by scripts/setup.sh")
    torch = pytest.importorskip("torch")
    from importlib.metadata import version

    from speculators import SpeculatorModel

    assert version("speculators").startswith("0.9")
    drafter = _drafter(target, seed=4)
    run = _run_with(tmp_path, drafter, target_dir)
    spec = drafter_to_hf.export(run, tmp_path / "spec", fmt="speculators", dtype="float32")
    model, info = SpeculatorModel.from_pretrained(spec, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(
        model.t2d,
        torch.from_numpy(np.asarray(jax.device_get(vocab_mappings(drafter.draft_vocab[...], 512)["t2d"]))),
    )
    model.load_verifier_weights()  # the embedding comes from the verifier (our target dir), not the export
    model.eval()

    # One block anchored at position 12 of a 24-token sequence, drafted by both.
    cfg, T, anchor, S = drafter.config, 24, 12, drafter.config.block_size
    ids = np.random.default_rng(0).integers(0, 512, size=(1, T)).astype(np.int32)
    feats = target(jnp.asarray(ids), layer_ids=tuple(cfg.target_layer_ids), return_logits=False).features
    anchors = jnp.array([[anchor]], jnp.int32)
    hidden = drafter.forward_train(
        feats,
        jnp.arange(T, dtype=jnp.int32)[None],
        jnp.ones((1, T), jnp.int32),
        anchors,
        jnp.array([[True]]),
        drafter.train_block_embeds(target, jnp.asarray(ids), anchors),
    )
    ours_logits = np.asarray(drafter.logits(hidden[:, :, 1:], target))[0, 0]  # [S-1, N]
    ours = np.asarray(drafter.to_target_ids(jnp.argmax(ours_logits, -1).astype(jnp.int32)))
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, anchor] = 1  # the one anchor speculators picks
    with torch.no_grad():
        _, logits, _, _, _ = model._backbone_forward(
            torch.from_numpy(np.asarray(feats, np.float32)),
            torch.from_numpy(ids).long(),
            loss_mask,
            torch.zeros(1, T, target.config.hidden_size),  # the verifier's own targets: unused here
            torch.ones(1, T, dtype=torch.long),
            max_anchors=1,
        )
    theirs_logits = logits[0, 1:S].numpy()
    np.testing.assert_allclose(theirs_logits, ours_logits, atol=1e-4)
    drafts = theirs_logits.argmax(-1)
    assert (drafts + model.d2t[drafts].numpy()).tolist() == ours.tolist()


# --------------------------------------------------------------------------- resume


# slow: two tiny runs (~60 s on 2 cores); the suite checks the same refusal for other keys
# (test_reliability.py::test_resume_refuses_shape_or_data_changes_naming_the_keys)
@pytest.mark.slow
def test_resume_with_another_draft_vocab_size_is_refused(tmp_path):
    from dflash_jax.config_io import ConfigError
    from dflash_jax.training.run import run
    from dflash_jax.training.run_config import load_run_config

    base = [
        f"output_dir={tmp_path / 'r'}",
        "train.steps=2",
        "eval.num_prompts=0",
        "drafter.draft_vocab_size=64",
    ]
    result = run(load_run_config("tiny", base), quiet=True)
    vocab = json.loads((tmp_path / "r" / "draft_vocab.json").read_text())
    assert vocab["draft_vocab_size"] == 64 and 0 < vocab["label_coverage"] <= 1
    ids = np.asarray(result["drafter"].draft_vocab[...])
    assert set(vocab["stop_ids"]) <= set(ids.tolist())
    with pytest.raises(ConfigError, match="drafter.draft_vocab_size: 64 -> 128"):
        run(
            load_run_config("tiny", [*base[:-1], "drafter.draft_vocab_size=128", "train.steps=3"]),
            resume=True,
            quiet=True,
        )
    # the same size resumes with the stored set, not a new choice
    again = run(
        load_run_config("tiny", [*base[:-2], "train.steps=3", "drafter.draft_vocab_size=64"]),
        resume=True,
        quiet=True,
    )
    assert np.array_equal(np.asarray(again["drafter"].draft_vocab[...]), ids)


# --------------------------------------------------------------------------- regeneration cache


def test_regenerated_data_is_keyed_by_what_changes_the_answers(tmp_path):
    """A new batch size, row length, feature source or feature budget reuses the answers; other
    prompts do not."""
    from dflash_jax.training.regen_cache import regen_key
    from dflash_jax.training.run_config import load_run_config

    (tmp_path / "config.json").write_text("{}")
    tok = type("Tok", (), {"name_or_path": "tok", "chat_template": "{{ x }}", "__len__": lambda self: 10})()

    def key(*overrides):
        return regen_key(load_run_config("demo", list(overrides)), tok, tmp_path)

    base = key()
    assert (
        key(
            "data.batch_size=1",
            "data.max_length=256",
            "data.features=null",
            "data.features_minutes=null",
            "train.learning_rate=0.01",
        )
        == base
    )
    assert key("data.features_minutes=3") == base
    assert key("data.max_records=100") != base
    assert key("regen.max_new_tokens=64") != base
    assert key("eval.max_new_tokens=64") != base  # the held-out answers' length
    assert key("eval.curve_prompts=4", "eval.curve_every_minutes=1") == base
    assert key("regen.answers=target") != base  # the demo keeps the data's replies
    assert key("data.heldout_count=8") != base
    assert key("data.validation_count=8") != base and key("eval.validation_prompts=4") != base
    assert key("target.dtype=float32") != base  # the target's greedy answers change with its dtype


def test_regenerated_files_without_held_out_answers_give_a_run_without_held_out_loss(tmp_path, caplog):
    """No held-out prompt answered: the run goes on without a held-out loss and says why; no
    training answer: an error naming the regeneration settings, not "no training records"."""
    from dflash_jax.data.sources import BadDataError, write_chat_jsonl
    from dflash_jax.training.regen_cache import data_configs
    from dflash_jax.training.run_config import load_run_config

    cfg = load_run_config("demo", [])
    record = {
        "id": "r0",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    }
    train, held, empty = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl", tmp_path / "empty.jsonl"
    write_chat_jsonl(train, [record])
    write_chat_jsonl(held, [record])
    write_chat_jsonl(empty, [])

    data_cfg, held_cfg = data_configs(cfg, train, held)
    assert data_cfg.sources == (str(train),) and held_cfg.sources == (str(held),)
    with caplog.at_level("WARNING"):
        data_cfg, held_cfg = data_configs(cfg, train, empty)
    assert data_cfg.sources == (str(train),) and held_cfg is None
    assert f"eval.num_prompts={cfg.eval.num_prompts} " in caplog.text and "no held-out loss" in caplog.text
    r = cfg.regen
    with pytest.raises(
        BadDataError,
        match=rf"regen.num_prompts={r.num_prompts} .*regen.max_prompt_tokens={r.max_prompt_tokens} ",
    ):
        data_configs(cfg, empty, held)
