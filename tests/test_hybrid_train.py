"""The training job end to end on configs/tiny-hybrid.yaml (a tiny Qwen3.5-hybrid target)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_jax.train import run
from dflash_jax.training.run_config import load_run_config


@pytest.mark.slow
def test_tiny_hybrid_trains_and_evaluates(tmp_path):
    cfg = load_run_config(
        "tiny-hybrid",
        [
            f"output_dir={tmp_path}",
            "train.steps=4",
            "train.warmup_steps=1",
            "train.log_every=1",
            "eval.num_prompts=2",
        ],
    )
    out = run(cfg, quiet=True)
    assert out["step"] == 4
    assert out["target"].config.model_type == "qwen3_5"
    assert "linear_attention" in out["target"].config.layer_types
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(losses) == 4 and np.all(np.isfinite(losses))
    # Held-out speculative decoding ran on the hybrid target before and after training.
    for when in ("before", "after"):
        rep = out[f"eval_{when}"]
        assert rep["num_prompts"] == 2 and rep["verify_steps"] > 0
        s = rep["summary"]  # every output token past each prompt's first came from a verify step
        assert rep["tau_pooled"] * rep["verify_steps"] == pytest.approx(s["output_tokens"] - 2)


def test_tiny_hybrid_train_steps_on_eight_devices(tmp_path):
    """Default-suite version: two train steps of the tiny hybrid on the 8 simulated devices (data=8),
    no held-out decoding. The DeltaNet prefill runs on every device at once, which is where a
    LAPACK triangular solve deadlocked the CPU thread pool."""
    cfg = load_run_config(
        "tiny-hybrid",
        [f"output_dir={tmp_path}", "train.steps=2", "train.warmup_steps=1", "train.log_every=1",
         "data.max_records=60", "train.checkpoint_every=100"],
    )  # fmt: skip
    out = run(cfg, quiet=True)
    assert out["step"] == 2 and "linear_attention" in out["target"].config.layer_types
    assert len(out["drafter"].fc[...].sharding.device_set) == 8
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(losses) == 2 and np.all(np.isfinite(losses))
