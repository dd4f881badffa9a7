"""A tiny training run with the Pallas kernel (interpret mode on CPU) follows the ``xla`` run's
loss curve: the kernel's forward and backward are what the optimizer sees."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_jax.train import run
from dflash_jax.training.run_config import load_run_config


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


@pytest.mark.slow  # interpret-mode kernels: minutes on a loaded 2-core CI box
def test_tiny_training_pallas_equals_xla(tmp_path):
    common = ["train.steps=5", "train.log_every=1", "train.warmup_steps=1", "train.checkpoint_every=100"]
    curves = {}
    for impl in ("xla", "pallas"):
        out = tmp_path / impl
        cfg = load_run_config("tiny", [f"output_dir={out}", f"drafter.attention_impl={impl}", *common])
        run(cfg, quiet=True)
        curves[impl] = _losses(out)
    assert sorted(curves["xla"]) == sorted(curves["pallas"]) == [1, 2, 3, 4, 5]
    xla = np.array([curves["xla"][s] for s in range(1, 6)])
    pallas = np.array([curves["pallas"][s] for s in range(1, 6)])
    assert np.ptp(xla) > 1e-3, "the loss should move over 5 steps (else the comparison says little)"
    np.testing.assert_allclose(pallas, xla, atol=1e-4, rtol=0)
