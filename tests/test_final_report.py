"""A run's final report: tau on a fixed slice of MT-Bench and HumanEval beside the test set, within
the time budget (issue 60, item 1), and the best checkpoint by validation tau kept beside the last
ones (item 4).

``--resume auto`` twice on a fresh directory (the first starts, the second resumes) is
``tests/test_reliability.py::test_resume_auto_starts_a_fresh_dir_then_resumes_it``.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dflash_jax.checkpoint import read_checkpoint, resolve_checkpoint
from dflash_jax.drafter.api import get_params
from dflash_jax.train import run
from dflash_jax.training import evaluation
from dflash_jax.training.run_config import load_run_config

# Validation tau of the curve's points in the order they are measured: the best (1.5) is neither
# the last nor in a checkpoint kept by the rotation, and the resumed run measures 1.4 first, the
# best only if the first run's record were lost.
TAUS = [1.2, 1.5, 1.1, 1.4, 1.3, 1.0]


def _tiny(run_dir, *overrides):
    """The tiny config shrunk to seconds per run, with a validation set and no test-set tau."""
    return load_run_config(
        "tiny",
        [
            f"output_dir={run_dir}",
            "data.max_records=40",
            "data.heldout_count=0",
            "data.validation_count=4",
            "data.max_length=64",
            "data.batch_size=2",
            "mesh.num_devices=1",
            "train.max_anchors=8",
            "train.warmup_steps=1",
            "train.steps=6",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=2",
            "eval.num_prompts=0",
            "eval.validation_prompts=2",
            "eval.curve_every_minutes=1e-7",  # a curve point after every step
            *overrides,
        ],
    )


def test_final_report_keeps_the_best_checkpoint_and_gives_tau_on_a_benchmark_slice(tmp_path, monkeypatch):
    """Two invocations of one run (a resume between): the best checkpoint is the step of the highest
    validation tau (injected), survives the rotation and the resume; the final report adds tau on the
    first MT-Bench and HumanEval conversations (one run checks both items: a tiny run is most of the
    cost)."""
    measured = []  # (tau, the drafter's params when it was measured)

    def fake_measure_tau(cfg, target, drafter, tokenizer, prompts, **kw):
        tau = TAUS[len(measured)]
        measured.append((tau, jax.tree.map(np.asarray, get_params(drafter))))
        return {"tau": tau, "tau_stderr": 0.1, "num_prompts": len(prompts), "method": "injected"}

    monkeypatch.setattr(evaluation, "measure_tau", fake_measure_tau)
    run_dir = tmp_path / "run"
    first = run(_tiny(run_dir), quiet=True, stop_at_step=3)
    assert first["best_checkpoint"]["validation_tau"] == 1.5 and "bench_after" not in first
    bench_slice = [
        "eval.final_bench=[mt-bench, humaneval]",
        "eval.final_bench_prompts=1",
        "eval.max_new_tokens=4",
    ]
    second = run(_tiny(run_dir, *bench_slice), resume=True, quiet=True)
    assert len(measured) == len(TAUS)

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["tau"] for r in rows if r["split"] == "validation"}
    assert sorted(curve.values()) == sorted(TAUS)
    best_step = max(curve, key=curve.get)
    assert best_step not in (second["step"], first["step"])
    # the rotation kept the last two steps only; the best is kept beside them
    _, last = resolve_checkpoint(run_dir)
    assert last == second["step"] == 6
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [5, 6]
    record = second["best_checkpoint"]
    assert record["step"] == best_step and record["validation_tau"] == 1.5 and record["method"] == "injected"
    assert resolve_checkpoint(run_dir / "best") == ((run_dir / "best").resolve(), best_step)
    assert record["path"] == str((run_dir / "best" / str(best_step)).resolve())
    # eval and export read it as a path: it holds the parameters of the step that measured 1.5
    drafter_config, params, _ = read_checkpoint(run_dir / "best")
    expected = next(p for tau, p in measured if tau == 1.5)
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    assert drafter_config == second["drafter"].config

    bench = second["bench_after"]
    assert list(bench) == ["mt-bench", "humaneval"]
    mt, he = bench["mt-bench"], bench["humaneval"]
    # MT-Bench's first question, both turns (the second after the target's answer); HumanEval/0
    assert (mt["num_conversations"], mt["num_prompts"], len(mt["tau_by_turn"])) == (1, 2, 2)
    assert (he["num_conversations"], he["num_prompts"], he["tau_stderr"]) == (1, 1, None)
    report = json.loads((run_dir / "eval_after_mt-bench.json").read_text())
    assert report["ids"] == ["mt-bench/81", "mt-bench/81"] and report["tau"] == mt["tau"] >= 1.0
    assert json.loads((run_dir / "eval_after_humaneval.json").read_text())["ids"] == ["HumanEval/0"]
    logged = {r["split"]: r["tau"] for r in rows if r["split"] in bench}
    assert logged == {k: v["tau"] for k, v in bench.items()}


def test_the_time_budget_sets_the_benchmark_slice_aside():
    import time

    from dflash_jax.training.schedule import training_minutes_in_budget, within_run_budget

    cfg = load_run_config("tiny", ["eval.num_prompts=32", "train.run_minutes=27"])
    t_start = time.perf_counter() - 420
    got = within_run_budget(cfg, t_start, 60.0, 0.0, 0, 32, bench_eval_s=90.0).time_limit_minutes
    assert got == pytest.approx(training_minutes_in_budget(27, 420, 60 + 90), abs=0.01)
    with pytest.raises(ValueError, match=r"eval.final_bench: unknown set\(s\) \['gsm8k'\]"):
        load_run_config("tiny", ["eval.final_bench=[gsm8k]"])
