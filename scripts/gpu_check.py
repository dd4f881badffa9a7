"""The kernel's GPU check (run by scripts/gpu_check.sh OUTDIR): correctness vs the dense reference,
speed and memory vs ``xla``, and a short tiny-config training run with the kernel. Writes
OUTDIR/gpu_check.json and OUTDIR/gpu_check.md (rewritten after every section, so a run cut short
still leaves what it measured).

``--cpu-smoke`` runs every section at tiny sizes on CPU (the kernel in interpret mode) to prove the
script works where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import attention_inputs, measure_attention, pallas_computed_fraction, visible_fraction
from pallas_kernels.anchored_attention import MASKED, context_attention

FULL = {
    "correctness": [  # (B, T, A, S, N, K, H, dtype)
        (2, 1024, 64, 16, 32, 8, 128, "bfloat16"),
        (2, 777, 37, 16, 8, 2, 64, "float32"),
    ],
    "speed": [(16, T, A, 16, 32, 8, 128, "bfloat16") for T in (2048, 8192) for A in (256, 512)],
    "train_steps": 20,
    "repeats": 5,
}
SMOKE = {
    "correctness": [(1, 96, 6, 4, 4, 2, 16, "bfloat16"), (1, 77, 5, 3, 4, 1, 16, "float32")],
    "speed": [(1, 256, 16, 16, 4, 2, 64, "bfloat16")],
    "train_steps": 2,
    "repeats": 1,
}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def check_correctness(shape) -> dict:
    B, T, A, S, N, K, H, dtype = shape
    (q, k, v, _, _), mask = attention_inputs(B, T, A, S, N, K, H, docs=3, dtype=dtype, seed=1)
    rng = np.random.default_rng(0)
    cot_o = jnp.asarray(rng.normal(size=q.shape).astype(np.float32))
    cot_lse = jnp.asarray(rng.normal(size=q.shape[:-1]).astype(np.float32))

    def run(impl):
        def loss(q, k, v):
            o, lse = context_attention(q, k, v, *mask, impl=impl)
            return jnp.sum(o * cot_o) + jnp.sum(jnp.where(lse > MASKED / 2, lse, 0.0) * cot_lse), (o, lse)

        (_, (o, lse)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return o, jnp.where(lse > MASKED / 2, lse, 0.0), *g

    got, want = run("pallas"), run("reference")
    errs = {
        name: rel_err(a, b) for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True)
    }
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    return {"shape": dict(B=B, T=T, A=A, S=S, N=N, K=K, H=H, dtype=dtype), "rel_err": errs,
            "tolerance": tol, "ok": all(e <= tol for e in errs.values())}  # fmt: skip


def check_speed(shape, repeats) -> dict:
    B, T, A, S, N, K, H, dtype = shape
    inputs, mask = attention_inputs(B, T, A, S, N, K, H, docs=4, dtype=dtype)
    frac, unmasked = pallas_computed_fraction(mask, H)
    row = {"shape": dict(B=B, T=T, A=A, S=S, N=N, K=K, H=H, dtype=dtype), "visible_fraction": visible_fraction(mask),
           "computed_fraction": frac, "mask_free_tile_share": unmasked}  # fmt: skip
    for impl in ("xla", "pallas"):
        row[impl] = measure_attention(impl, inputs, mask, repeats=repeats)
    if "fwd_bwd_ms" in row["xla"] and "fwd_bwd_ms" in row["pallas"]:
        row["speedup"] = row["xla"]["fwd_bwd_ms"] / row["pallas"]["fwd_bwd_ms"]
    return row


def check_training(steps, outdir: Path) -> dict:
    from dflash_jax.train import run
    from dflash_jax.training.run_config import load_run_config

    curves = {}
    for impl in ("xla", "pallas"):
        run_dir = outdir / f"tiny_{impl}"
        overrides = [f"output_dir={run_dir}", f"drafter.attention_impl={impl}", f"train.steps={steps}",
                     f"train.warmup_steps={min(10, steps - 1)}", "train.log_every=1", "train.checkpoint_every=100000"]  # fmt: skip
        t0 = time.perf_counter()
        run(load_run_config("tiny", overrides), quiet=True)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        curves[impl] = {"losses": [r["loss"] for r in rows if r["split"] == "train"],
                        "seconds": time.perf_counter() - t0}  # fmt: skip
    diff = float(np.max(np.abs(np.subtract(curves["pallas"]["losses"], curves["xla"]["losses"]))))
    return {"steps": steps, "max_abs_loss_diff": diff, **curves}


def markdown(report: dict) -> str:
    lines = [f"# gpu_check ({report['device']}, jax {report['jax']})", ""]
    lines += ["## kernel vs reference (relative max error)", "", "| shape | out | lse | dq | dk | dv | ok |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report.get("correctness", []):
        if "error" in r:
            lines.append(f"| {r.get('shape')} | error: {r['error'][:120]} |||||| no |")
            continue
        e = r["rel_err"]
        lines.append(f"| {r['shape']} | " + " | ".join(f"{e[k]:.1e}" for k in ("out", "lse", "dq", "dk", "dv"))
                     + f" | {'yes' if r['ok'] else 'NO'} |")  # fmt: skip
    lines += ["", "## fwd+bwd: pallas vs xla", "",
              "| B | T | A | visible | computed | xla ms | pallas ms | speedup | xla temp MiB | pallas temp MiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report.get("speed", []):
        if "error" in r:
            lines.append(f"| error: {r['error'][:200]} |||||||||")
            continue
        s, x, p = r["shape"], r["xla"], r["pallas"]

        def num(d, key, fmt=".1f"):
            return format(d[key], fmt) if key in d else d.get("error", "-")[:80]

        lines.append(
            f"| {s['B']} | {s['T']} | {s['A']} | {r['visible_fraction']:.3f} | {r['computed_fraction']:.3f} | "
            f"{num(x, 'fwd_bwd_ms')} | {num(p, 'fwd_bwd_ms')} | {num(r, 'speedup', '.2f')} | "
            f"{num(x, 'temp_mib', '.0f')} | {num(p, 'temp_mib', '.0f')} |"
        )
    t = report.get("training")
    if t:
        lines += ["", "## tiny config training", ""]
        if "error" in t:
            lines.append(f"error: {t['error']}")
        else:
            lines.append(f"{t['steps']} steps; max |loss(pallas) - loss(xla)| = {t['max_abs_loss_diff']:.2e}; "
                         f"final loss pallas {t['pallas']['losses'][-1]:.4f}, xla {t['xla']['losses'][-1]:.4f}")  # fmt: skip
    lines += ["", f"total {report.get('seconds', 0):.0f} s"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (interpret mode)")
    args = p.parse_args(argv)
    plan = SMOKE if args.cpu_smoke else FULL
    if not args.cpu_smoke and jax.default_backend() not in ("gpu", "cuda"):
        print("gpu_check: no GPU backend; use --cpu-smoke to exercise the script on CPU", file=sys.stderr)
        return 2
    jax.config.update("jax_default_matmul_precision", "highest")  # the fp32 reference without TF32
    args.outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "cpu_smoke": args.cpu_smoke,
    }

    def save():
        report["seconds"] = time.perf_counter() - t0
        (args.outdir / "gpu_check.json").write_text(json.dumps(report, indent=2))
        (args.outdir / "gpu_check.md").write_text(markdown(report))

    def section(name, fn, *xs):
        try:
            result = fn(*xs)
        except Exception as e:  # noqa: BLE001 - record and go on with the other sections
            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {json.dumps(result)[:400]}", flush=True)
        return result

    report["correctness"] = []
    for shape in plan["correctness"]:
        report["correctness"].append(section("correctness", check_correctness, shape))
        save()
    report["speed"] = []
    for shape in plan["speed"]:
        report["speed"].append(section("speed", check_speed, shape, plan["repeats"]))
        save()
    report["training"] = section("training", check_training, plan["train_steps"], args.outdir)
    save()
    ok = all(r.get("ok") for r in report["correctness"]) and "error" not in report["training"]
    print(markdown(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
