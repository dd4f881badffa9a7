"""End-to-end training runs on the shipped tiny config: exact resume, mesh invariance, learning."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dflash_jax.config_io import ConfigError
from dflash_jax.drafter.api import get_params
from dflash_jax.train import main, run
from dflash_jax.training.run_config import load_run_config, shipped_configs


def tiny(tmp_path, *overrides):
    return load_run_config("tiny", [f"output_dir={tmp_path}", "train.log_every=1", *overrides])


def losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def test_resume_is_exact(tmp_path):
    """N steps, stop, resume N more == 2N steps straight (params bit-identical on CPU)."""
    common = ["train.steps=6", "train.checkpoint_every=100", "train.warmup_steps=2"]
    straight = run(tiny(tmp_path / "a", *common, "eval.num_prompts=2"), quiet=True)
    # The held-out evaluation ran real speculative decoding before and after training.
    for when in ("before", "after"):
        rep = straight[f"eval_{when}"]
        assert rep["num_prompts"] == 2 and rep["verify_steps"] > 0
        s = rep["summary"]  # every output token past each prompt's first came from a verify step
        assert rep["tau_pooled"] * rep["verify_steps"] == pytest.approx(s["output_tokens"] - 2)
        assert straight[f"tau_{when}"] == s["tau"]
        assert (tmp_path / "a" / f"eval_{when}.json").is_file()
    first = run(tiny(tmp_path / "b", *common), quiet=True, stop_at_step=3)
    assert first["step"] == 3
    second = run(tiny(tmp_path / "b", *common), quiet=True, resume=True)
    assert second["start_step"] == 3 and second["step"] == 6
    pa = jax.tree.leaves(get_params(straight["drafter"]))
    pb = jax.tree.leaves(get_params(second["drafter"]))
    assert len(pa) == len(pb) > 0
    for a, b in zip(pa, pb, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [la[s] for s in range(1, 7)] == [lb[s] for s in range(1, 7)]


def test_regenerated_run_replays_tau_and_checks_it_against_decoding(tmp_path):
    """With the target's cached greedy answers to the eval prompts, tau before training and on the
    curve is replayed, and the decoding after training reports its replay beside it: equal per prompt.
    The curve is the validation set's, before and after training the test set's."""
    from dflash_jax import assets

    cfg = tiny(
        tmp_path / "run",
        "train.steps=4",
        "train.warmup_steps=1",
        "regen.enabled=true",
        "regen.answers=dataset",
        "regen.num_prompts=40",
        "eval.num_prompts=2",
        "data.validation_count=4",
        "eval.validation_prompts=3",
        "eval.curve_every_minutes=0.0001",  # a curve point after every step
    )
    result = run(cfg, quiet=True)
    before, after = result["eval_before"], result["eval_after"]
    assert before["split"] == after["split"] == "test" and result["tau_after_stderr"] == after["tau_stderr"]
    assert before["method"] == "replay" and after["method"] == "speculative decoding"
    assert before["num_prompts"] == after["num_prompts"] == 2
    replayed = after["replay"]
    assert replayed["method"] == "replay" and replayed["verify_steps"] == after["verify_steps"] > 0
    assert replayed["per_prompt_tau"] == after["per_prompt_tau"]
    # the regeneration cache's key holds the run's own tiny target: its newest entry is this run's
    newest = max(
        (assets.cache_root() / "regenerated").glob("*/heldout_answers.json"), key=lambda p: p.stat().st_mtime
    )
    answers = json.loads(newest.read_text())
    assert len(answers["prompts"]) == 2 and answers["max_new_tokens"] == cfg.eval.max_new_tokens
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    taus = [(r["step"], r["tau"]) for r in rows if r["split"] == "heldout" and "tau" in r]
    assert taus == [(0, before["tau"]), (4, after["tau"])]
    curve = [r["step"] for r in rows if r["split"] == "validation" and "tau" in r]
    assert curve == [0, 1, 2, 3, 4, 4]  # before, the curve, after
    validation = json.loads(newest.with_name("validation_answers.json").read_text())
    assert len(validation["prompts"]) == 3 and not set(map(tuple, validation["prompts"])) & set(
        map(tuple, answers["prompts"])
    )


def test_eight_devices_data_tensor_layout_matches_one_device(tmp_path):
    common = ["train.steps=4", "train.warmup_steps=1"]
    one = run(tiny(tmp_path / "one", *common, "mesh.num_devices=1", "mesh.data=1"), quiet=True)
    eight = run(tiny(tmp_path / "eight", *common, "mesh.data=2", "mesh.tensor=4"), quiet=True)
    fc = eight["drafter"].fc[...]
    assert len(fc.sharding.device_set) == 8
    l1, l8 = losses(tmp_path / "one"), losses(tmp_path / "eight")
    assert sorted(l1) == sorted(l8) == [1, 2, 3, 4]
    # Losses are ~10-14 here: 1e-5 absolute plus 1e-6 relative is fp32 reduction-order noise.
    np.testing.assert_allclose([l8[s] for s in l8], [l1[s] for s in l1], atol=1e-5, rtol=1e-6)
    assert one["step"] == eight["step"] == 4


def test_bad_config_is_named(tmp_path, capsys):
    with pytest.raises(ConfigError, match="train.lerning_rate"):
        load_run_config("tiny", ["train.lerning_rate=0.1"])
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_run_config("tiny", ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"train.loss: unknown 'mse'; must be one of \['ce', 'kl'\]"):
        load_run_config("tiny", ["train.loss=mse"])
    assert main(["--config", "tiny", "drafter.bogus=1"]) == 2
    assert "drafter.bogus" in capsys.readouterr().err


def test_run_minutes_spent_before_training_stops_the_run_naming_the_budget(tmp_path):
    """The budget is applied after the evaluation before training (which times the final one)."""
    cfg = tiny(tmp_path, "train.steps=2", "eval.num_prompts=1", "train.run_minutes=0.001")
    with pytest.raises(ConfigError, match=r"train.run_minutes=0.001: .* leave no time to train"):
        run(cfg, quiet=True)
    assert (tmp_path / "eval_before.json").is_file()


@pytest.mark.slow
def test_tiny_streak_rises(tmp_path):
    """Measured (seed 0): streak 1.00 at the start, ~1.19 after 200 steps; threshold 1.08."""
    result = run(load_run_config("tiny", [f"output_dir={tmp_path}"]), quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    first, last = train[0]["streak"], np.mean([r["streak"] for r in train[-3:]])
    assert first < 1.03
    assert last > 1.08, (first, last)
    assert result["step"] == 200
    assert (tmp_path / "metrics.png").stat().st_size > 1000
    assert any((tmp_path / "tensorboard").iterdir())


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_loads(name):
    cfg = load_run_config(name)
    assert cfg.name == name and cfg.train.steps >= 1
