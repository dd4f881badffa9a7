"""scripts/gpu_check.py, the staged GPU check, exercised on CPU: a stage that fails or hangs past
its budget is recorded and the later stages still run; the full-size stage's CPU smoke measures the
trainer's step and reports its fields; a GPU run's result becomes validated.json entries (for the
device kind it ran on) and BENCHMARKS.md's GPU section only where the kernel passed and beat xla."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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
        "compile=8,target=120",  # target: room for a loaded box, it must end "ok"
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    st = report["stages"]
    assert st["env"]["status"] == "failed" and "injected failure in stage 'env'" in st["env"]["error"]
    assert st["compile"]["status"] == "timeout" and "8 s budget" in st["compile"]["error"]
    assert st["compile"]["seconds"] < 30
    assert st["target"]["status"] == "ok", st["target"]
    tg = st["target"]["result"]
    (case,) = tg["cases"]  # the smoke's one length: the kernel (interpret mode) against the XLA path
    assert case["xla"]["ms"] > 0 and case["pallas"]["ms"] > 0
    assert tg["pallas_ok"] and case["pallas"]["rel_err_vs_xla"] <= tg["tolerance"] == 1e-4
    assert "cudnn_one_doc" not in case and tg["sweep"][0]["status"] == "ok"  # no cuDNN off GPU
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| compile | timeout |" in md and "| target | ok |" in md
    assert "| 1 x 64 |" in md and "the kernel matches XLA within 0.0001" in md
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


def test_full_stage_smoke_measures_the_trainers_step(tmp_path):
    # a generous budget: the stage's compile is tens of seconds on a loaded 2-core box
    proc, report = run_check(tmp_path, "--stages", "full", "--budgets", "full=400", "--total", "420")
    full = report["stages"]["full"]
    assert full["status"] == "ok", (full, proc.stdout[-2000:])
    res = full["result"]
    assert (res["target_layers"], res["drafter_layers"], res["block_size"]) == (4, 2, 16)
    assert res["vocab"] == 512 and res["draft_vocab"] == 256 and res["loss"] == "ce"
    (v,) = res["variants"]
    assert v["status"] == "ok" and v["attention_impl"] == "auto" and v["rows"] == 1
    assert v["ms_per_step"] > 0 and v["compile_s"] > 0 and v["plan_peak_gib"] > 0
    assert v["tokens_per_s"] == pytest.approx(128 / (v["ms_per_step"] / 1e3))
    assert v["anchors_per_s"] == pytest.approx(8 / (v["ms_per_step"] / 1e3))  # 8 anchors a row, all drawn
    gc = load_script()
    assert res["peak_tflops"] is None and "mfu" not in v  # no bf16 peak for a CPU
    from dflash_jax.tools import flops

    cfg, tc = gc._full_run_config(gc.SMOKE["full"])
    assert tc.num_layers == 4 and tc.vocab_size == 512
    assert res["mem_fraction"] == gc.FULL_MEM_FRACTION  # the stage's own process got the larger pool
    assert "xla" in res["auto_choice"]  # auto off GPU
    ta = res["target_attention"]
    assert ta["xla"]["ms"] > 0 and ta["pallas"]["ms"] > 0 and "cudnn_one_doc" not in ta
    assert ta["xla_ms_x_layers"] == pytest.approx(4 * ta["xla"]["ms"])
    assert v["tflops_per_step"] > flops.target_forward_flops(tc, 128) / 1e12  # target + labels + drafter
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| auto | 1 |" in md and "4 target layers" in md and "256-token draft vocabulary" in md


def test_record_adds_the_kind_the_check_ran_on(tmp_path):
    gc = load_script()
    from pallas_kernels.anchored_attention import validated

    assert gc.peak_tflops("NVIDIA H100 80GB HBM3") == gc.peak_tflops("NVIDIA H200") == 989.0
    assert gc.peak_tflops("NVIDIA H100 PCIe") == 756.0 and gc.peak_tflops("cpu") is None
    kind = "NVIDIA H100 80GB HBM3"  # jax's device_kind of an H100 SXM
    variant = dict(attention_impl="auto", rows=1, status="ok", ms_per_step=520.0, tokens_per_s=7877.0,
                   anchors_per_s=985.0, tflops_per_step=230.0, mfu=0.447, plan_peak_gib=48.2,
                   device_peak_gib=50.1, compile_s=70.0, drafter_compute_dtype="bfloat16",
                   drafter_matmul_dtype="bfloat16")  # fmt: skip
    full = dict(device_kind=kind, target_layers=36, hidden=4096, vocab=151936, draft_vocab=32000,
                drafter_layers=5, block_size=16, seq_len=4096, anchors_per_row=512, target_dtype="bfloat16",
                loss="ce", peak_tflops=989.0, memory_pool_gib=73.2, variants=[variant],
                auto_choice="attention_impl=auto: using 'xla' (no GPU check has validated ...)",
                target_attention={"shape": dict(B=1, T=4096, N=32, K=8, H=128, dtype="bfloat16", docs_per_row=4),
                                  "xla": {"ms": 3.1}, "xla_ms_x_layers": 111.6,
                                  "pallas": {"ms": 1.5}, "pallas_ms_x_layers": 54.0,
                                  "cudnn_one_doc": {"ms": 1.0, "xla_one_doc_ms": 6.0, "xla_over_cudnn": 6.0,
                                                    "pallas_one_doc_ms": 1.8, "pallas_over_cudnn": 1.8}})  # fmt: skip
    report = {
        "cpu_smoke": False, "order": ["env", "correctness", "speed", "full"], "seconds": 500.0,
        "stages": {
            "env": {"status": "ok", "seconds": 5, "result": {"device_kind": kind, "jax": "0.11.2"}},
            "correctness": {"status": "ok", "seconds": 60, "result": {"cases": [], "pallas_ok": True}},
            "speed": {"status": "ok", "seconds": 60, "result": {
                "shape": dict(B=16, T=8192, A=512, S=16, N=32, K=8, H=128, dtype="bfloat16"),
                "visible_fraction": 0.1, "computed_fraction": 0.2, "tiles": None,
                "xla": {"fwd_bwd_ms": 30.0}, "pallas": {"fwd_bwd_ms": 10.0, "speedup_vs_xla": 3.0}}},
            "full": {"status": "ok", "seconds": 200, "result": full},
        },
    }  # fmt: skip
    (tmp_path / "result.json").write_text(json.dumps(report))
    table = tmp_path / "validated.json"
    shutil.copy(validated.TABLE_PATH, table)  # the shipped table, whatever kinds it holds
    before = validated.load(table)
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text(f"## GPU\n\n{gc.BENCH_BEGIN}\nold\n{gc.BENCH_END}\n")
    (row,) = gc.record(tmp_path, validated_path=table, benchmarks=bench)
    after = validated.load(table)
    assert validated.lookup(kind, 128, 4, "bfloat16", False, table=after) == row
    assert row["impl"] == "pallas" and row["speedup_vs_xla"] == 3.0
    assert [r for r in after if r["device_kind"] != kind] == [r for r in before if r["device_kind"] != kind]
    assert len(after) == len([r for r in before if r["device_kind"] != kind]) + 1
    text = bench.read_text()
    assert f"full-size step on one {kind}" in text
    assert "| auto | 1 | 520.0 | 7877 | 985 | 230.0 | 44.7% | 48.2 | 50.1 | 70 | ok |" in text
    assert "pallas 1.50 ms (x 36 layers: 54 ms)" in text
    assert "cuDNN 1.00 ms, xla 6.00 ms (xla / cuDNN 6.00), pallas 1.80 ms (pallas / cuDNN 1.80)" in text


def test_record_validates_the_segment_kernel_only_where_it_matched_and_was_faster(tmp_path):
    gc = load_script()
    from pallas_kernels.segment_attention import validated

    def case(T, xla_ms, pallas_ms, err):
        return {"shape": dict(B=2, T=T, N=32, K=8, H=128, dtype="bfloat16", docs_per_row=4),
                "xla": {"ms": xla_ms}, "pallas": {"ms": pallas_ms, "rel_err_vs_xla": err,
                                                  "speedup_vs_xla": xla_ms / pallas_ms},
                "cudnn_one_doc": {"ms": 2.0, "xla_one_doc_ms": 24.0, "pallas_one_doc_ms": 3.0,
                                  "xla_over_cudnn": 12.0, "pallas_over_cudnn": 1.5}}  # fmt: skip

    best = {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
    target = {"device_kind": "NVIDIA H100 80GB HBM3", "head_dim": 128, "groups": 4, "dtype": "bfloat16",
              "tolerance": 2e-2, "cases": [case(4096, 6.0, 2.0, 2e-3), case(8192, 24.0, 6.0, 3e-3)],
              "pallas_ok": True, "speedup_vs_xla": 3.0, "best_tiles": best, "best_ms": 5.5,
              "default_tiles": {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}}  # fmt: skip
    report = {"cpu_smoke": False, "order": ["env", "target"], "seconds": 60.0, "stages": {
        "env": {"status": "ok", "seconds": 5, "result": {"device_kind": target["device_kind"], "jax": "0.11.2"}},
        "target": {"status": "ok", "seconds": 40, "result": target}}}  # fmt: skip
    table = tmp_path / "segment.json"
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text(f"{gc.BENCH_BEGIN}\n{gc.BENCH_END}\n")

    def run():
        (tmp_path / "result.json").write_text(json.dumps(report))
        return gc.record(tmp_path, validated_path=tmp_path / "drafter.json", benchmarks=bench,
                         segment_validated_path=table)  # fmt: skip

    (entry,) = run()
    assert validated.lookup("NVIDIA H100 80GB HBM3", 128, 4, "bfloat16", table=validated.load(table)) == entry
    assert entry["tiles"] == best and entry["speedup_vs_xla"] == 3.0 and entry["lengths"] == [4096, 8192]
    assert not (tmp_path / "drafter.json").exists()  # no drafter stages ran: nothing for that kernel
    text = bench.read_text()
    assert "| 2 x 8192 | 24.00 | 6.00 | 4.00 | 3.0e-03 | 2.00 | 24.00 | 3.00 | 1.50" in text
    table.unlink()
    target["speedup_vs_xla"] = 0.9  # slower than XLA at one length
    assert run() == [] and not table.exists()
    target.update(speedup_vs_xla=3.0, pallas_ok=False)
    assert run() == [] and not table.exists()


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
    assert report["order"] == list(load_script().DEFAULT_STAGES)
    assert [report["stages"][s]["status"] for s in report["order"]] == ["ok"] * 7
