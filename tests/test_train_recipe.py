"""What training trains (invariant 5 and the slot weighting): anchors up to the end of every reply,
per-slot masks as a running product along the block, and D-PACE weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash_jax import assets
from dflash_jax.data.chat import tokenize_conversation
from dflash_jax.training.anchors import anchor_candidates, sample_anchors, slot_targets
from dflash_jax.training.loss import dpace_weights, weighted_slot_loss

B = 8


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(assets.qwen3_tokenizer_dir())


def pack(docs, T):
    """Documents [(ids, loss_mask)] -> one packed row (segment ids 1, 2, ...; 0 = padding)."""
    ids, mask, seg = np.zeros(T, np.int32), np.zeros(T, bool), np.zeros(T, np.int32)
    at = 0
    for i, (d_ids, d_mask) in enumerate(docs, start=1):
        n = len(d_ids)
        ids[at : at + n], mask[at : at + n], seg[at : at + n] = d_ids, d_mask, i
        at += n
    assert at <= T
    return ids, mask, seg


def all_anchor_targets(mask, seg, block_size=B):
    """Every candidate anchor of a single row, with its slot targets (numpy)."""
    mask, seg = jnp.asarray(mask[None]), jnp.asarray(seg[None])
    cand = np.asarray(anchor_candidates(mask, seg))[0]
    anchors = np.nonzero(cand)[0].astype(np.int32)
    label_pos, trained = slot_targets(
        jnp.asarray(anchors[None]), jnp.ones((1, len(anchors)), bool), mask, seg, block_size
    )
    return anchors, np.asarray(label_pos)[0], np.asarray(trained)[0]


def test_short_reply_at_document_end_gets_an_anchor_and_eot_is_a_slot_one_label(qwen):
    """A 2-token reply at the end of a document (shorter than B-1) still starts blocks, and the
    end-of-turn token is the label of slot 1 of the block anchored just before it."""
    chat = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes"}]
    ids, mask = tokenize_conversation(qwen, chat, enable_thinking=False)
    reply = np.nonzero(mask)[0]
    assert len(reply) < B - 1, qwen.decode(ids[mask])
    eot = qwen.convert_tokens_to_ids("<|im_end|>")
    assert ids[reply[-1]] == eot
    other_ids, other_mask = tokenize_conversation(
        qwen, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]
    )
    row_ids, row_mask, row_seg = pack([(ids, mask), (other_ids, other_mask)], len(ids) + len(other_ids) + 5)
    anchors, label_pos, trained = all_anchor_targets(row_mask, row_seg)
    assert set(reply[:-1]) <= set(anchors.tolist()), "every reply token but the last starts a block"
    eot_at = int(reply[-1])
    j = anchors.tolist().index(eot_at - 1)
    assert trained[j, 0] and label_pos[j, 0] == eot_at - 1  # slot 1 predicts token eot_at
    assert row_ids[label_pos[j, 0] + 1] == eot
    assert not trained[j, 1:].any(), "nothing past the end of the document is trained"


def test_block_stops_at_the_end_of_its_reply(qwen):
    """A block near the end of a reply trains no slot in the following user turn, nor in the next
    reply (which is back inside the loss mask): the per-slot mask is a running product."""
    chat = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red is a fine colour for many things."},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "Blue, green and yellow are colours as well."},
    ]
    ids, mask = tokenize_conversation(qwen, chat, enable_thinking=False)
    runs = np.split(np.nonzero(mask)[0], np.nonzero(np.diff(np.nonzero(mask)[0]) > 1)[0] + 1)
    first, second = runs[0], runs[1]
    gap = second[0] - first[-1] - 1
    block = 24
    assert 0 < gap < block - 3, "the user turn in between must fit in a block"
    anchors, label_pos, trained = all_anchor_targets(mask, np.ones_like(ids), block)
    a = int(first[-3])  # two trained slots left in the first reply, then the user turn
    j = anchors.tolist().index(a)
    predicted = a + np.arange(1, block)
    assert trained[j].tolist() == [True, True] + [False] * (block - 3)
    assert (predicted[~trained[j]] > first[-1]).all()
    # Without the running product slots inside the second reply would be trained.
    assert mask[predicted[gap + 2 :]].any()


@pytest.mark.parametrize("seed", range(2))
def test_no_slot_label_lies_in_another_document_or_past_the_row(seed):
    rng = np.random.default_rng(seed)
    R, T = 3, 64
    seg = np.zeros((R, T), np.int32)
    mask = rng.random((R, T)) < 0.7
    for r in range(R):
        cuts = np.sort(rng.choice(np.arange(1, T), size=4, replace=False))
        seg[r] = np.searchsorted(cuts, np.arange(T), side="right") + 1
        seg[r, T - rng.integers(0, 6) :] = 0  # a padded tail
    anchors, valid = sample_anchors(jax.random.key(seed), jnp.asarray(mask), jnp.asarray(seg), max_anchors=40)
    label_pos, trained = slot_targets(anchors, valid, jnp.asarray(mask), jnp.asarray(seg), B)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    label_pos, trained = np.asarray(label_pos), np.asarray(trained)
    assert valid.any() and trained.any() and (~trained[valid]).any()
    for r in range(R):
        for j in np.nonzero(valid[r])[0]:
            a = anchors[r, j]
            assert mask[r, a] and mask[r, a + 1] and seg[r, a] == seg[r, a + 1] != 0
            assert (0 <= label_pos[r, j]).all() and (label_pos[r, j] < T).all()
            assert (seg[r, label_pos[r, j]] == seg[r, a]).all()
            for k in np.nonzero(trained[r, j])[0] + 1:  # slot k predicts a+k
                assert a + k < T and seg[r, a + k] == seg[r, a] and mask[r, a + 1 : a + k + 1].all()
                assert label_pos[r, j, k - 1] == a + k - 1
            # ...and every slot that could train does (trained slots are the longest such prefix).
            n = int(trained[r, j].sum())
            if n < B - 1:
                nxt = a + n + 1
                assert nxt >= T or not mask[r, nxt] or seg[r, nxt] != seg[r, a]
    assert not trained[~valid].any()


def dpace_reference(ce, trained, alpha):
    """The published formula, slot by slot."""
    w = np.zeros_like(ce)
    for b in range(ce.shape[0]):
        P, s_prod = np.zeros(ce.shape[1]), 1.0
        for k in range(ce.shape[1]):
            s = (1 - alpha) * np.exp(-ce[b, k]) + alpha if trained[b, k] else 1.0
            s_prod *= s
            P[k] = s_prod
        for k in range(ce.shape[1]):
            if trained[b, k]:
                w[b, k] = sum(P[m] for m in range(k, ce.shape[1]) if trained[b, m])
    return w


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8])
def test_dpace_weights_match_the_formula(alpha):
    ce = np.array(
        [
            [0.1, 0.7, 2.0, 0.3, 1.5, 0.05, 3.0],
            [0.2, 0.4, 0.9, 1.1, 0.0, 0.6, 0.8],
            [1.0, 2.0, 0.3, 0.1, 0.2, 0.3, 0.4],
        ],
        np.float32,
    )
    trained = np.array(
        [
            [1, 1, 0, 1, 1, 0, 0],  # untrained slots in the middle and at the end
            [1, 1, 1, 1, 1, 1, 1],
            [1, 0, 0, 0, 0, 0, 0],
        ],
        bool,
    )
    want = dpace_reference(ce.astype(np.float64), trained, alpha)
    got = np.asarray(dpace_weights(jnp.asarray(ce), jnp.asarray(trained), alpha))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    loss = weighted_slot_loss(jnp.asarray(ce), jnp.asarray(trained), scheme="dpace", dpace_alpha=alpha)
    np.testing.assert_allclose(float(loss), (want * ce).sum() / trained.sum(), rtol=1e-6)


def test_dpace_weights_carry_no_gradient():
    ce = jnp.array([[0.3, 0.9, 1.2]])
    trained = jnp.array([[True, True, True]])
    grad = jax.grad(lambda c: weighted_slot_loss(c, trained, scheme="dpace"))(ce)
    w = dpace_weights(ce, trained, 0.5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(w) / 3, rtol=1e-6)


# --------------------------------------------------------------------------- the real step


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    from hf_fixtures import save_hf_model

    return save_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"), seed=5)


def step_batch(R=4, T=48, vocab=512, seed=0):
    """Packed rows: two documents per row, replies with a user turn in between."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(R, T)).astype(np.int32)
    seg = np.ones((R, T), np.int32)
    seg[:, T // 2 :] = 2
    seg[R - 1, T - 5 :] = 0  # padding
    positions = np.where(seg == 2, np.arange(T) - T // 2, np.arange(T)).astype(np.int32)
    positions[seg == 0] = 0
    mask = np.zeros((R, T), np.int32)
    mask[:, 5:14] = mask[:, 17:22] = 1  # reply, 3-token user turn, reply
    mask[:, T // 2 + 4 : T - 6] = 1
    return {
        "input_ids": ids,
        "positions": positions,
        "segment_ids": seg,
        "loss_mask": mask,
    }


def test_loss_uses_the_decoding_logits_function(tiny_target_dir):
    """With logit_scale != 1 and a soft-cap, the loss the step computes is the CE of the logits
    decoding uses (``drafter.logits``), not of the raw lm_head."""
    import dflash_jax
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.training.run_config import TrainSection
    from dflash_jax.training.step import drafter_loss, target_pass

    target = dflash_jax.load_target(tiny_target_dir)
    dcfg = dflash_jax.DrafterConfig.for_target(
        target.config, num_layers=1, mask_token_id=7, block_size=B, logit_scale=2.5, logit_softcap=4.0
    )
    drafter = init_drafter(dcfg, target, 0)
    batch = {k: jnp.asarray(v) for k, v in step_batch().items()}
    cfg = TrainSection(max_anchors=6, loss_weighting="uniform", loss_chunk=16)
    key = jax.random.key(3)
    loss, metrics = drafter_loss(drafter, target, batch, key, cfg, with_labels=True)

    # Decoding's side: the same blocks, logits through drafter.logits (what decoding/speculative/step.py calls).
    k_anchor, _ = jax.random.split(key)
    anchors, valid = sample_anchors(k_anchor, batch["loss_mask"], batch["segment_ids"], max_anchors=6)
    features, _ = target_pass(target, batch, dcfg.target_layer_ids)
    embeds = drafter.train_block_embeds(target, batch["input_ids"], anchors)
    hidden = drafter.forward_train(features, batch["positions"], batch["segment_ids"], anchors, valid, embeds)
    logits = np.asarray(drafter.logits(hidden[:, :, 1:], target), np.float64)
    assert np.abs(logits).max() <= 4.0 + 1e-5, "the soft-cap applies"
    _, trained = slot_targets(anchors, valid, batch["loss_mask"], batch["segment_ids"], B)
    trained, labels = np.asarray(trained), np.asarray(metrics["labels"])
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    want = ce[trained].mean()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    raw = np.asarray(hidden[:, :, 1:] @ target.lm_head_weight(), np.float64)
    raw_logp = raw - np.log(np.exp(raw).sum(-1, keepdims=True))
    raw_ce = -np.take_along_axis(raw_logp, labels[..., None], -1)[..., 0]
    assert abs(raw_ce[trained].mean() - want) > 1e-2, "the check must tell the two logits apart"


def test_dpace_loss_is_the_same_on_one_and_eight_devices(tiny_target_dir):
    """The normalisation (the global trained-slot count) does not depend on the batch split."""
    import dflash_jax
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.sharding import BATCH_AXES, MeshConfig, logical_sharding, make_mesh, shard_module
    from dflash_jax.training.run_config import TrainSection
    from dflash_jax.training.step import make_eval_step

    cfg = TrainSection(max_anchors=8, loss_weighting="dpace", loss_chunk=32)
    eval_step = make_eval_step(cfg)
    host = step_batch(R=4)
    out = {}
    for name, layout in (("one", MeshConfig(num_devices=1, data=1)), ("eight", MeshConfig(data=2, tensor=4))):
        mesh = make_mesh(layout)
        target = dflash_jax.load_target(tiny_target_dir, mesh=mesh)
        dcfg = dflash_jax.DrafterConfig.for_target(target.config, num_layers=1, mask_token_id=7, block_size=B)
        drafter = init_drafter(dcfg, target, 0)
        shard_module(drafter, mesh)
        sharding = logical_sharding(mesh, BATCH_AXES)
        batch = {k: jax.device_put(jnp.asarray(v), sharding) for k, v in host.items()}
        with jax.set_mesh(mesh):
            m = eval_step(drafter, target, batch, jax.random.key(0))
        if name == "eight":
            assert len(batch["input_ids"].sharding.device_set) == 8
            assert len(drafter.fc[...].sharding.device_set) == 8
        out[name] = float(m["loss"])
    assert out["one"] > 0
    np.testing.assert_allclose(out["eight"], out["one"], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- warm start


def zlab_drafter_for_tiny(directory):
    """A z-lab drafter (written by z-lab's own DFlashDraftModel) for configs/tiny.yaml's target:
    a sliding and a full layer, a non-default mask token, taps in a non-sorted order."""
    torch = pytest.importorskip("torch")
    dm = pytest.importorskip("dflash.model")
    from hf_fixtures import zlab_drafter_config

    torch.manual_seed(0)
    cfg = zlab_drafter_config(
        mask_token_id=7,
        target_layer_ids=[3, 1],
        num_target_layers=4,
        block_size=4,
        vocab_size=49152,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    dm.DFlashDraftModel(cfg).save_pretrained(directory)
    return directory


def test_warm_start_keeps_the_source_drafters_shape(tmp_path):
    import json

    from convert import drafter_to_hf
    from dflash_jax.config_io import ConfigError
    from dflash_jax.train import run
    from dflash_jax.training.run_config import load_run_config

    dm = pytest.importorskip("dflash.model")
    src = zlab_drafter_for_tiny(tmp_path / "zlab")
    common = [f"drafter.init_from={src}", "drafter.num_layers=null", "eval.num_prompts=0"]
    cfg = load_run_config(
        "tiny", [f"output_dir={tmp_path / 'run'}", *common, "train.steps=1", "train.warmup_steps=0"]
    )
    result = run(cfg, quiet=True)
    assert result["step"] == 1
    out = drafter_to_hf.export(tmp_path / "run", tmp_path / "export")
    orig, new = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for key in ("layer_types", "sliding_window", "use_sliding_window", "block_size", "num_target_layers"):
        assert new[key] == orig[key], key
    assert new["intermediate_size"] == 96 and new["num_hidden_layers"] == 2
    assert new["dflash_config"]["mask_token_id"] == 7
    assert new["dflash_config"]["target_layer_ids"] == [3, 1]
    model = dm.DFlashDraftModel.from_pretrained(out)  # z-lab reads it back
    assert model.target_layer_ids == [3, 1] and model.block_size == 4
    assert [layer.self_attn.sliding_window for layer in model.layers] == [8, None]

    # A config value that contradicts the source is an error naming both values.
    bad = load_run_config("tiny", [f"output_dir={tmp_path / 'bad'}", *common, "drafter.mask_token_id=5"])
    with pytest.raises(ConfigError, match=r"mask_token_id=5 conflicts .* mask_token_id=7"):
        run(bad, quiet=True)
    bad = load_run_config("tiny", [f"output_dir={tmp_path / 'bad2'}", f"drafter.init_from={src}"])
    with pytest.raises(ConfigError, match=r"num_layers=1 conflicts .* num_layers=2"):
        run(bad, quiet=True)


# --------------------------------------------------------------------------- learning-rate schedule


def test_learning_rate_matches_optax_schedule():
    import optax

    from dflash_jax.training.run_config import TrainSection
    from dflash_jax.training.schedule import learning_rate

    train = TrainSection(steps=50, warmup_steps=5, learning_rate=1e-3, end_lr_ratio=0.1)
    for decay_steps in (50, 23):
        ref = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, decay_steps, 1e-4)
        got = [learning_rate(train, s, decay_steps) for s in range(50)]
        np.testing.assert_allclose(got, [float(ref(s)) for s in range(50)], rtol=1e-5, atol=1e-9)


class _Clock:
    """Seconds that advance only when a step runs (by what the test's step adds)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _timed_loop(step_seconds, limit_minutes: float, steps: int = 400):
    """The Trainer with the run's schedule and time-limit hooks and a fake clock: step n (1-based)
    takes ``step_seconds(n)`` seconds. -> (the loop's result, the schedule, the schedule lengths it
    reported, the rate of every step)."""
    from dflash_jax.training.hooks import StopAt
    from dflash_jax.training.run_config import TrainSection
    from dflash_jax.training.schedule import LearningRateSchedule
    from dflash_jax.training.trainer import Trainer, TrainState

    clock = _Clock()
    rates = []

    def train_step(drafter, optimizer, target, batch, key, lr):
        clock.t += step_seconds(len(rates) + 1)
        rates.append(float(lr))
        return {
            "loss": jnp.float32(1.0),
            "tokens": jnp.int32(10),
            "streak": jnp.float32(1.0),
            "skipped": jnp.int32(0),
            "grad_norm": jnp.float32(1.0),
        }

    class Batches:  # the loop's data iterator interface: next() plus a checkpointable state
        def __init__(self):
            self.i = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.i += 1
            return self.i

        def get_state(self):
            return {"i": self.i}

    told = []
    train = TrainSection(
        steps=steps, warmup_steps=2, learning_rate=1e-3, time_limit_minutes=limit_minutes, log_every=5
    )
    schedule = LearningRateSchedule(train, on_decay_steps=told.append)
    trainer = Trainer(
        train, train_step, target=None, put=lambda b: b, learning_rate=schedule.rate, clock=clock
    )
    trainer.add_hook(schedule)
    trainer.add_hook(StopAt(minutes=train.time_limit_minutes))
    done = trainer.train(TrainState(None, None), Batches())
    return done, schedule, told, rates


def test_time_budget_sets_the_schedule_length():
    """With a 1-minute budget and 2 s steps (after a 30 s compile), ~15 steps fit: the rate is
    decayed by the last of them, although train.steps is 400."""
    from dflash_jax.training.schedule import TIMED_STEPS

    done, schedule, told, rates = _timed_loop(lambda n: 30.0 if n == 1 else 2.0, 1.0)
    # 30 s compile + 2 s/step: after 1 + TIMED_STEPS steps (36 s), (60 - 36) / 2 = 12 more fit; the
    # second measurement (after 10 % of the budget) finds the same step time and changes nothing.
    assert told == [1 + TIMED_STEPS + 12] == [schedule.decay_steps]
    assert done.step == 17 and done.stop_reason == "time limit"  # the first step past 60 s
    assert rates[schedule.decay_steps - 1] < 0.12e-3, "decayed to ~end_lr by the last step that fits"
    assert rates[schedule.decay_steps] == rates[-1] == pytest.approx(1e-4), "end_lr past the estimate"
    assert rates[2] == pytest.approx(1e-3)  # warm-up done, peak


def test_time_budget_measures_the_step_again_when_it_slows():
    """The first steps after compiling run faster than the rest (checkpoint saves, logging): the
    schedule's length is measured again after 10 % of the budget, so the rate still ends decayed."""
    from dflash_jax.training.schedule import REFINE_FRACTION

    assert REFINE_FRACTION == 0.1
    # 10 minutes: a 30 s compile, 10 steps of 1 s, then 1.25 s a step.
    done, schedule, told, rates = _timed_loop(
        lambda n: 30.0 if n == 1 else 1.0 if n <= 11 else 1.25, 10.0, steps=2000
    )
    # step 4 (33 s): 1 s a step, 4 + 567 fit; step 51 (90 s, 60 s after compiling): 1.2 s a step, 51 + 425
    assert told == [571, 476] and schedule.decay_steps == 476
    assert done.step == 460  # 40 + 1.25 * (460 - 11) > 600
    # from the first estimate alone the last rate would be 1.84e-4 (80 % of the way down)
    assert rates[-1] < 1.05e-4
    assert rates[50] == pytest.approx(rates[49], rel=0.01), "no jump where the length changes"


def test_run_minutes_leaves_training_what_the_evaluations_and_the_margin_do_not_take():
    import time

    from dflash_jax.config_io import ConfigError
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.schedule import (
        RESUMED_CURVE_EVAL_S,
        RESUMED_FINAL_EVAL_S,
        training_minutes_in_budget,
        within_run_budget,
    )

    # 27 min, 7 spent, a 60 s final evaluation, 30 s margin, curve points of 8 s every 4 minutes.
    got = training_minutes_in_budget(27, 420, 60, curve_eval_s=8, curve_every_minutes=4)
    assert got == pytest.approx((1620 - 420 - 60 - 30) / (1 + 8 / 240) / 60)
    assert training_minutes_in_budget(27, 420, 60) == pytest.approx((1620 - 510) / 60)

    def budget(*overrides, start_step=0, eval_s=60.0, curve_s=7.5):
        cfg = load_run_config(
            "tiny",
            ["eval.num_prompts=32", "eval.max_new_tokens=128", "eval.curve_every_minutes=4", *overrides],
        )
        t_start = time.perf_counter() - 420  # 7 minutes ago
        return within_run_budget(cfg, t_start, eval_s, curve_s, start_step, 32).time_limit_minutes

    want = training_minutes_in_budget(27, 420, 60, curve_eval_s=7.5, curve_every_minutes=4)
    assert budget("train.run_minutes=27") == pytest.approx(want, abs=0.01)
    assert budget("train.run_minutes=27", "train.time_limit_minutes=3") == 3  # the smaller wins
    assert budget("train.run_minutes=27", "train.time_limit_minutes=60") == pytest.approx(want, abs=0.01)
    assert budget() is None and budget("train.time_limit_minutes=5") == 5  # no budget: untouched
    assert budget("train.run_minutes=27", "eval.curve_every_minutes=null") == pytest.approx(
        training_minutes_in_budget(27, 420, 60), abs=0.01
    )
    resumed = training_minutes_in_budget(
        27, 420, RESUMED_FINAL_EVAL_S, RESUMED_CURVE_EVAL_S, curve_every_minutes=4
    )
    assert budget("train.run_minutes=27", start_step=100, eval_s=0.0, curve_s=0.0) == pytest.approx(
        resumed, abs=0.01
    )
    with pytest.raises(ConfigError, match=r"train.run_minutes=8: 7.0 minutes spent"):
        budget("train.run_minutes=8")


def test_run_minutes_needs_the_evaluation_that_times_the_final_one():
    from dflash_jax.training.run_config import load_run_config

    with pytest.raises(ValueError, match="train.run_minutes needs eval.before_training=true"):
        load_run_config("tiny", ["eval.num_prompts=4", "eval.before_training=false", "train.run_minutes=5"])
    load_run_config("tiny", ["eval.num_prompts=0", "eval.before_training=false", "train.run_minutes=5"])
    with pytest.raises(ValueError, match="train.run_minutes must be > 0"):
        load_run_config("tiny", ["train.run_minutes=0"])
