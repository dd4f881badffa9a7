"""scripts/gpu_check.py, the staged GPU check, exercised on CPU: a stage that fails or hangs past
its budget is recorded and the later stages still run; a GPU run's result becomes validated.json
entries and BENCHMARKS.md's GPU section only where the kernel passed and beat xla."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_check(outdir, *args, timeout=600):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a GPU host's CPU side
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(outdir), "--cpu-smoke", *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    return proc, json.loads((outdir / "result.json").read_text())


def test_failed_and_hung_stages_do_not_stop_later_ones(tmp_path):
    proc, report = run_check(
        tmp_path,
        "--stages",
        "env,compile,target",
        "--inject-failure",
        "env,compile:hang",
        "--budgets",
        "compile=8",
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    st = report["stages"]
    assert st["env"]["status"] == "failed" and "injected failure in stage 'env'" in st["env"]["error"]
    assert st["compile"]["status"] == "timeout" and "8 s budget" in st["compile"]["error"]
    assert st["compile"]["seconds"] < 30
    assert st["target"]["status"] == "ok", st["target"]
    assert st["target"]["result"]["ours"]["ms"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| compile | timeout |" in md and "| target | ok |" in md
    log = (tmp_path / "gpu_check.log").read_text()
    assert log.index("===== env") < log.index("===== compile") < log.index("===== target")


def test_record_validates_only_a_passing_faster_kernel(tmp_path):
    gc = load_script()
    from pallas_kernels.anchored_attention import validated
    from pallas_kernels.anchored_attention.pallas_triton import TileConfig

    best = TileConfig(block_q=128, num_warps=8).to_dict()
    report = {
        "cpu_smoke": False, "order": ["env", "correctness", "speed", "sweep"], "seconds": 300.0,
        "stages": {
            "env": {"status": "ok", "seconds": 5, "result": {"device_kind": "NVIDIA H200", "jax": "0.11.2"}},
            "correctness": {"status": "ok", "seconds": 60, "result": {"cases": [], "pallas_ok": True}},
            "speed": {"status": "ok", "seconds": 60, "result": {
                "shape": dict(B=16, T=8192, A=512, S=16, N=32, K=8, H=128, dtype="bfloat16"),
                "visible_fraction": 0.1, "computed_fraction": 0.2, "tiles": None,
                "xla": {"fwd_bwd_ms": 30.0}, "pallas": {"fwd_bwd_ms": 12.0, "speedup_vs_xla": 2.5}}},
            "sweep": {"status": "ok", "seconds": 60, "result": {"best_tiles": best, "best_ms": {}}},
        },
    }  # fmt: skip
    (tmp_path / "result.json").write_text(json.dumps(report))
    (tmp_path / "gpu_check.md").write_text(gc.markdown(report))
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text(f"# B\n\n## GPU\n\n{gc.BENCH_BEGIN}\nold\n{gc.BENCH_END}\n\n## CPU\nkept\n")
    table = tmp_path / "validated.json"
    rows = gc.record(tmp_path, validated_path=table, benchmarks=bench)
    entry = validated.lookup("NVIDIA H200", 128, 4, "bfloat16", False, table=validated.load(table))
    assert rows == [entry] and entry["impl"] == "pallas" and entry["tiles"] == best
    text = bench.read_text()
    assert "old" not in text and "| pallas | - | 12.00 |" in text and text.endswith("## CPU\nkept\n")

    report["stages"]["speed"]["result"]["pallas"] = {"fwd_bwd_ms": 40.0, "speedup_vs_xla": 0.75}
    (tmp_path / "result.json").write_text(json.dumps(report))
    table.unlink()
    assert gc.record(tmp_path, validated_path=table, benchmarks=bench) == []  # slower than xla
    report["stages"]["speed"]["result"]["pallas"]["speedup_vs_xla"] = 2.0
    report["stages"]["correctness"] = {"status": "timeout", "result": {"cases": []}}  # not all cases ran
    (tmp_path / "result.json").write_text(json.dumps(report))
    assert gc.record(tmp_path, validated_path=table, benchmarks=bench) == []
    report["cpu_smoke"] = True
    (tmp_path / "result.json").write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="validates nothing"):
        gc.record(tmp_path, validated_path=table, benchmarks=bench)


def test_fallback_and_sweep_candidates_fit_the_budget():
    gc = load_script()
    from pallas_kernels.anchored_attention import budget

    cands = gc.fallback_tiles(128, 2)
    assert len(set(cands)) == len(cands) >= 5
    assert not any(budget.problems(cands[0], 128, 4, 2).values())  # the default is tried first
    fwd, bwd = gc.sweep_candidates(128, 4, 2, limit=50)
    assert fwd and bwd
    assert all(not budget.problems(t, 128, 4, 2, ("forward",))["forward"] for t in fwd)
    assert all(not any(budget.problems(t, 128, 4, 2, ("dq", "dkdv")).values()) for t in bwd)


@pytest.mark.slow  # every stage in interpret mode: 150-250 s on a 2-core box
def test_cpu_smoke_runs_every_stage_in_under_5_minutes(tmp_path):
    t0 = time.perf_counter()
    proc, report = run_check(tmp_path)
    assert time.perf_counter() - t0 < 300
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert [report["stages"][s]["status"] for s in report["order"]] == ["ok"] * 7
