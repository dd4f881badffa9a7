"""The GPU check, as staged checks that each run in their own process with their own time budget
(run by ``scripts/gpu_check.sh OUTDIR``; whole run < 10 min on one H100 or H200, compiles included):

  env          versions, devices, what imports (tokamax, grain), the kernels' budget at the shapes below
  compile      a small real shape: forward, forward+dq, forward+dk/dv compiled separately (a failure
               names its kernel), trying the fallback tiles in order until each compiles
  correctness  the kernel test base's cases (+ two larger ones) vs the dense reference, fp32 at
               highest precision and bf16, values and gradients; tokamax where it imports
  speed        pallas vs xla (vs tokamax) at T=8192, A=512, B=16, 32/8 heads, d=128, bf16: fwd and
               fwd+bwd time, compiled temp memory
  sweep        tile candidates within the budget, forward and backward kernels timed alone; the best
               becomes the recorded default
  target       the target's packed causal attention at T=4096 and 8192, Qwen3-8B's heads: the segment
               attention kernel vs the tiled XLA path (values and ms) vs tokamax, and cuDNN's time on
               one document a row (the only mask it expresses here); then the kernel's tiles swept
  full         the trainer's step at full size on one GPU: Qwen3-8B's 36 layers (bf16, random weights
               made on the device), a 5-layer B=16 drafter, T=4096, 512 anchors a row, the whole
               vocabulary for the labels and a 32k draft vocabulary; ms/step, tokens/s, anchors/s,
               MFU (analytic FLOPs), peak memory; then the target's attention at that shape vs cuDNN
  train        (only with --stages) the step of qwen3-8b reduced to a few layers, the drafter in fp32
               and in bf16, each with pallas and xla: tokens/s and MFU (analytic FLOPs)

OUTDIR/result.json and OUTDIR/gpu_check.md are rewritten after every stage; a stage that fails,
crashes or runs past its budget is recorded and the next one runs. Each function is compiled once
(``lower().compile()``), then timed. ``--cpu-smoke`` runs every stage at tiny sizes on CPU
(kernels in interpret mode). ``--record OUTDIR`` (run in the repo after a GPU run) writes the
validated configurations into ``pallas_kernels/anchored_attention/validated.json`` (the drafter's
kernel) and ``pallas_kernels/segment_attention/validated.json`` (the target's), keyed by the device
kind the check ran on, and the markdown into BENCHMARKS.md's GPU section.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("env", "compile", "correctness", "speed", "sweep", "target", "full", "train")
# What a plain run runs: the reduced `train` stage no longer fits one 10-minute command beside `full`.
DEFAULT_STAGES = ("env", "compile", "correctness", "speed", "sweep", "target", "full")
# Seconds per stage on one GPU (process start, imports and compiles included); the default stages'
# sum + margin < 590 (gpu_check.sh's timeout). Measured on an H200 on 2026-12-04: env 3-5, compile
# 16, correctness 92 (tokamax failing), speed 45, train 119 (four variants), target 10 (the XLA path
# and cuDNN at one length, before the segment kernel); the sweeps take what they are given; `full`
# and `target` are estimates until a GPU run measures them (`full`: one compile of the 36-layer step
# and a few steps of ~0.5 s per variant, the later variants only where time is left; `target`: ~10
# compiles of ~1.5 s at two lengths, then the kernel's tile candidates while time is left).
BUDGET_S = {
    "env": 10,
    "compile": 30,
    "correctness": 120,
    "speed": 55,
    "sweep": 60,
    "target": 45,
    "full": 240,
    "train": 130,
}
# CPU smoke (interpret mode on a shared 2-core box): the default stages' sum stays under 5 minutes.
SMOKE_BUDGET_S = {
    "env": 15,
    "compile": 45,
    "correctness": 50,
    "speed": 50,
    "sweep": 35,
    "target": 30,
    "full": 75,
    "train": 75,
}
TOTAL_S = 565
SMOKE_TOTAL_S = 295
# The full-size stage's process may use this much of the GPU (JAX's default pool is 75 %); a user's
# XLA_PYTHON_CLIENT_MEM_FRACTION wins.
FULL_MEM_FRACTION = "0.92"
# bf16 dense tensor-core peak per device (TFLOP/s), for MFU: the first name contained in the
# device kind wins (jax says e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200").
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
)
BENCH_BEGIN, BENCH_END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"

# (B, T, A, S, N, K, H, dtype)
FULL = {
    "compile": (2, 1024, 32, 16, 32, 8, 128, "bfloat16"),
    "correctness_extra": [(2, 1024, 64, 16, 32, 8, 128, "bfloat16"), (2, 777, 37, 16, 8, 2, 64, "float32")],
    "correctness_cases": None,  # all of kernel_test_base.CASES
    "correctness_dtypes": ("float32", "bfloat16"),
    "speed": (16, 8192, 512, 16, 32, 8, 128, "bfloat16"),
    "sweep": (8, 8192, 512, 16, 32, 8, 128, "bfloat16"),
    "sweep_max": 8,
    "repeats": 5,
    "train": dict(
        layers=4,
        drafter_layers=1,
        rows=2,
        seq=4096,
        anchors=512,
        steps=3,
        impls=("pallas/float32", "xla/float32", "pallas/bfloat16", "xla/bfloat16"),
    ),
    # packed rows of 4 documents at Qwen3-8B's heads; the kernel's tile candidates timed at the last
    "target": dict(
        rows=((2, 4096), (2, 8192)), heads=(32, 8, 128), dtype="bfloat16", tokamax=True, sweep_max=6
    ),
    # Qwen3-8B as configs/qwen3-8b.yaml describes it, every layer, on one device. Variants run in
    # order while the budget allows (each costs about what the first did): the shipped `auto`
    # attention at one row, the Pallas kernels (drafter's and target's) forced where `auto` chose
    # otherwise, then two rows.
    "full": dict(
        target_layers=36,
        drafter_layers=5,
        block_size=16,
        seq=4096,
        anchors=512,
        draft_vocab=32000,
        steps=3,
        variants=(("auto", 1), ("pallas", 1), ("auto", 2)),
    ),
}
SMOKE = {
    "compile": (1, 64, 4, 4, 4, 2, 16, "bfloat16"),
    "correctness_extra": [(1, 77, 5, 3, 4, 1, 16, "float32")],
    "correctness_cases": ("window",),
    "correctness_dtypes": ("bfloat16",),
    "speed": (1, 128, 8, 4, 4, 2, 16, "bfloat16"),
    "sweep": (1, 128, 8, 4, 4, 2, 16, "bfloat16"),
    "sweep_max": 1,
    "repeats": 1,
    "train": dict(
        layers=2,
        drafter_layers=1,
        rows=1,
        seq=128,
        anchors=4,
        steps=1,
        tiny=True,
        impls=("xla/float32", "xla/bfloat16"),
    ),
    "target": dict(rows=((1, 64),), heads=(4, 2, 16), dtype="float32", tokamax=True, sweep_max=1),
    "full": dict(  # a few layers: the CPU compile of the unrolled drafter is what costs here
        target_layers=4,
        drafter_layers=2,
        taps=(1, 2),
        block_size=16,
        seq=128,
        anchors=8,
        draft_vocab=256,
        steps=1,
        tiny=True,
        variants=(("auto", 1),),
    ),
}


# ------------------------------------------------------------------------------------ helpers


class StageFailed(RuntimeError):
    """A stage that failed but has results to record (which cases, which kernels)."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _jax():
    import jax

    return jax


def on_gpu() -> bool:
    return _jax().default_backend() in ("gpu", "cuda")


def timed_ms(compiled, args, repeats: int) -> float:
    """Median milliseconds of ``compiled(*args)`` over ``repeats`` calls after one warm-up."""
    jax = _jax()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def compile_once(fn, *args):
    """``(compiled, seconds, temp MiB)``: one ``lower().compile()``."""
    t0 = time.perf_counter()
    compiled = _jax().jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes / 2**20 if mem is not None else None
    return compiled, time.perf_counter() - t0, temp


def shape_dict(shape):
    return dict(zip(("B", "T", "A", "S", "N", "K", "H", "dtype"), shape, strict=True))


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:600]


def tiles_from(prior: dict, key: str = "tiles"):
    """The tiles an earlier stage chose (sweep's best, else compile's), or None for the default."""
    from pallas_kernels.anchored_attention.pallas_triton import TileConfig

    for stage in ("sweep", "compile"):
        got = prior.get(stage, {}).get("result", {}).get("best_tiles" if stage == "sweep" else key)
        if got:
            return TileConfig(**got)
    return None


def peak_tflops(device_kind: str) -> float | None:
    """The bf16 dense peak of ``device_kind`` (see PEAK_TFLOPS), None for a kind not listed."""
    for name, peak in PEAK_TFLOPS:
        if name in device_kind:
            return peak
    return None


def use_tiles(prior: dict):
    """Make the bf16 kernels' default tiles the ones the compile/sweep stages chose (this process)."""
    from pallas_kernels.anchored_attention import pallas_triton as pt

    tiles = tiles_from(prior)
    if tiles is not None:
        default = pt.TileConfig.default
        pt.TileConfig.default = classmethod(
            lambda cls, head_dim, itemsize=2: tiles if itemsize == 2 else default(head_dim, itemsize)
        )
    return tiles


def tokamax_ok() -> str | None:
    from pallas_kernels.anchored_attention import tokamax_impl

    return tokamax_impl.available()


# --------------------------------------------------------------------------------------- stages


def stage_env(plan, prior, outdir) -> dict:
    import importlib.util

    jax = _jax()
    from pallas_kernels.anchored_attention import budget
    from pallas_kernels.anchored_attention.pallas_triton import TileConfig

    out = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "python": sys.version.split()[0],
        "imports": {
            m: importlib.util.find_spec(m) is not None for m in ("tokamax", "grain", "tensorboardX", "flax")
        },
        "tokamax": tokamax_ok() or "ok",
    }
    B, T, A, S, N, K, H, dtype = plan["speed"]
    itemsize = 2 if dtype == "bfloat16" else 4
    est = budget.estimate(TileConfig.default(H, itemsize), H, N // K, itemsize)
    out["budget"] = {
        k: {"shared_bytes": b.shared_bytes, "registers": b.registers_per_thread} for k, b in est.items()
    }
    return out


def _kernel_setup(shape, tiles, interpret, seed=0):
    """Inputs of the three kernels at ``shape``; raises ValueError for tiles over budget."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.tools.bench import attention_inputs
    from pallas_kernels.anchored_attention import pallas_triton as pt

    B, T, A, S, N, K, H, dtype = shape
    (q, kc, vc, _, _), mask = attention_inputs(B, T, A, S, N, K, H, docs=3, dtype=dtype, seed=seed)
    st, q_rows, k_p, v_p, meta = pt.kernel_inputs(
        q, kc, vc, tuple(mask), window=None, scale=H**-0.5, interpret=interpret, tiles=tiles
    )
    Qp = q_rows.shape[1]
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.normal(size=q_rows.shape).astype(np.float32)).astype(q_rows.dtype)
    lse = jnp.asarray(rng.normal(size=(B, N, Qp)).astype(np.float32)) + 5.0
    delta = jnp.asarray(rng.normal(size=(B, N, Qp)).astype(np.float32))
    bwd_args = (q_rows, k_p, v_p, meta, do, lse, delta)
    fns = {
        "forward": (functools.partial(pt.forward_call, st), (q_rows, k_p, v_p, meta)),
        "dq": (functools.partial(pt.dq_call, st), bwd_args),
        "dkdv": (functools.partial(pt.dkdv_call, st), bwd_args),
    }
    return fns


def fallback_tiles(head_dim: int, itemsize: int):
    """Candidates in the order the compile stage tries them: the default, fewer pipeline stages,
    smaller backward tiles, more warps, the G heads unrolled (where the budget allows)."""
    from pallas_kernels.anchored_attention.pallas_triton import TileConfig

    d = TileConfig.default(head_dim, itemsize)
    half = dict(block_q_bwd=max(16, d.block_q_bwd // 2), block_k_bwd=max(16, d.block_k_bwd // 2))
    return [
        d,
        d.replace(num_stages=1, num_stages_bwd=1, num_stages_dkdv=1),
        d.replace(**half),
        d.replace(**half, num_stages_bwd=1, num_stages_dkdv=1, num_warps_bwd=8),
        d.replace(block_q=max(16, d.block_q // 2), block_k=max(16, d.block_k // 2), **half, num_stages=1),
        d.replace(dkdv_groups="unroll", num_stages_dkdv=1),
    ]


def stage_compile(plan, prior, outdir) -> dict:
    """Forward, dq and dk/dv compiled separately; per kernel the first candidate that compiles and
    runs. The backward kernels share their tile sizes, so dq and dk/dv pick one candidate together."""
    shape = plan["compile"]
    itemsize = 2 if shape[-1] == "bfloat16" else 4
    interpret = not on_gpu()
    tries = {"forward": [], "dq": [], "dkdv": []}
    winners = {}

    def attempt(tiles, kernels):
        try:
            fns = _kernel_setup(shape, tiles, interpret)
        except ValueError as e:  # over budget: not compiled
            for k in kernels:
                tries[k].append({"tiles": tiles.to_dict(), "status": "over budget", "error": err_text(e)})
            return False
        ok = True
        for k in kernels:
            fn, args = fns[k]
            try:
                compiled, secs, temp = compile_once(fn, *args)
                ms = timed_ms(compiled, args, 2)
                tries[k].append({"tiles": tiles.to_dict(), "status": "ok", "compile_s": secs, "ms": ms})
            except Exception as e:  # noqa: BLE001 - the next candidate is tried
                tries[k].append({"tiles": tiles.to_dict(), "status": "failed", "error": err_text(e)})
                ok = False
        progress({"shape": shape_dict(shape), "tries": tries})
        return ok

    candidates = fallback_tiles(shape[6], itemsize)
    for t in candidates:
        if attempt(t, ["forward"]):
            winners["forward"] = t
            break
    for t in candidates:
        if attempt(t, ["dq", "dkdv"]):
            winners["backward"] = t
            break
    out = {"shape": shape_dict(shape), "tries": tries}
    if "forward" in winners and "backward" in winners:
        f, b = winners["forward"], winners["backward"]
        fwd_fields = ("block_q", "block_k", "num_warps", "num_stages")
        out["tiles"] = b.replace(**{k: getattr(f, k) for k in fwd_fields}).to_dict()
    failed = [k for k in ("forward", "backward") if k not in winners]
    if failed:
        raise StageFailed(f"no candidate tiles compiled for the {' and '.join(failed)} kernel(s)", out)
    return out


def _rel_err(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def stage_correctness(plan, prior, outdir) -> dict:
    jax = _jax()
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from kernel_test_base import CASES, packed_case, run_impl

    from dflash_jax.tools.bench import attention_inputs
    from pallas_kernels.anchored_attention import MASKED, AnchoredMask
    from pallas_kernels.anchored_attention.pallas_triton import TileConfig

    jax.config.update("jax_default_matmul_precision", "highest")  # this process only: fp32 without TF32
    small = TileConfig(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
    chosen = tiles_from(prior)
    interpret = not on_gpu()
    tk = tokamax_ok() is None
    rows = []
    tokamax_failed = []  # tokamax is a comparison: once it fails, the budget goes to our kernel's cases

    def compare(name, qkv, mask, window, dtype, impl, options):
        row = {"case": name, "dtype": dtype, "impl": impl, "window": window}
        if impl == "tokamax" and tokamax_failed:
            row.update(ok=False, error=f"skipped: tokamax failed on {tokamax_failed[0]}")
            rows.append(row)
            return
        try:
            ref = run_impl("reference", {}, window, qkv, mask)
            got = run_impl(impl, options, window, qkv, mask)
            seen = np.asarray(ref[1]) > MASKED / 2
            errs = {
                "out": _rel_err(got[0], ref[0]),
                "lse": _rel_err(np.where(seen, got[1], 0), np.where(seen, ref[1], 0)),
            }
            errs.update(
                {n: _rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), got[2], ref[2], strict=True)}
            )
            tol = 2e-2 if dtype == "bfloat16" else 1e-4
            row.update(
                rel_err=errs,
                tolerance=tol,
                ok=all(np.isfinite(list(errs.values()))) and max(errs.values()) <= tol,
            )
        except Exception as e:  # noqa: BLE001 - one case does not stop the others
            row.update(ok=False, error=err_text(e))
            if impl == "tokamax":
                tokamax_failed.append(f"{name}/{dtype}")
        rows.append(row)
        print(json.dumps(row)[:300], flush=True)
        progress({"cases": rows})

    # the real-shape cases first: a stage cut short by its budget keeps what matters most
    for shape in plan["correctness_extra"]:
        B, T, A, S, N, K, H, dtype = shape
        (q, kc, vc, _, _), m = attention_inputs(B, T, A, S, N, K, H, docs=3, dtype=dtype, seed=1)
        mask = AnchoredMask(*m)
        options = {"interpret": interpret, **({"tiles": chosen} if chosen is not None else {})}
        compare(f"B{B}_T{T}_A{A}_H{H}", (q, kc, vc), mask, None, dtype, "pallas", options)
        if tk and dtype == "bfloat16" and on_gpu():
            compare(f"B{B}_T{T}_A{A}_H{H}", (q, kc, vc), mask, None, dtype, "tokamax", {})
    names = (
        sorted(set(CASES) - {"one_by_one"})
        if plan["correctness_cases"] is None
        else plan["correctness_cases"]
    )
    for name in names:
        kwargs, window = CASES[name]
        for dtype in plan["correctness_dtypes"]:
            qkv, mask = packed_case(**kwargs, dtype=jnp.dtype(dtype))
            compare(name, qkv, mask, window, dtype, "pallas", {"interpret": interpret, "tiles": small})
            if tk and window is None and dtype == "bfloat16" and on_gpu():
                compare(name, qkv, mask, window, dtype, "tokamax", {})
    bad = [r for r in rows if not r["ok"] and r["impl"] == "pallas"]
    out = {
        "cases": rows,
        "pallas_ok": not bad,
        "tokamax_ok": all(r["ok"] for r in rows if r["impl"] == "tokamax"),
    }
    out["tokamax_ran"] = any(r["impl"] == "tokamax" for r in rows)
    if bad:
        raise StageFailed(
            f"{len(bad)} pallas case(s) off the reference: {[r['case'] + '/' + r['dtype'] for r in bad]}", out
        )
    return out


def _attention_fns(impl, mask, tiles):
    import jax.numpy as jnp

    from dflash_jax.drafter.attention import anchored_attention

    opts = {"tiles": tiles} if impl in ("pallas", "tokamax") and tiles is not None else {}
    if impl == "pallas" and not on_gpu():
        opts["interpret"] = True

    def fwd(q, kc, vc, kb, vb):
        o = anchored_attention(q, kc, vc, kb, vb, mask, causal=False, window=None, impl=impl, **opts)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    return fwd, _jax().value_and_grad(fwd, argnums=(0, 1, 2, 3, 4))


def stage_speed(plan, prior, outdir) -> dict:
    from dflash_jax.tools.bench import attention_inputs, pallas_computed_fraction, visible_fraction

    B, T, A, S, N, K, H, dtype = plan["speed"]
    inputs, mask = attention_inputs(B, T, A, S, N, K, H, docs=4, dtype=dtype)
    tiles = tiles_from(prior)
    frac, unmasked = pallas_computed_fraction(mask, H, tiles)
    out = {"shape": shape_dict(plan["speed"]), "visible_fraction": visible_fraction(mask),
           "computed_fraction": frac, "mask_free_tile_share": unmasked,
           "tiles": tiles.to_dict() if tiles else None}  # fmt: skip
    impls = ["xla", "pallas"] + (["tokamax"] if tokamax_ok() is None and on_gpu() else [])
    for impl in impls:
        res = {}
        fwd, fwd_bwd = _attention_fns(impl, mask, tiles)
        for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            try:
                compiled, secs, temp = compile_once(fn, *inputs)
                res[f"{name}_ms"] = timed_ms(compiled, inputs, plan["repeats"])
                res[f"{name}_temp_mib"], res[f"{name}_compile_s"] = temp, secs
            except Exception as e:  # noqa: BLE001 - the other impls still run
                res[f"{name}_error"] = err_text(e)
        out[impl] = res
        print(impl, json.dumps(res)[:300], flush=True)
        progress(out)
    for impl in impls[1:]:
        if "fwd_bwd_ms" in out[impl] and "fwd_bwd_ms" in out["xla"]:
            out[impl]["speedup_vs_xla"] = out["xla"]["fwd_bwd_ms"] / out[impl]["fwd_bwd_ms"]
    return out


def sweep_candidates(head_dim, groups, itemsize, limit):
    """Forward and backward candidates within the budget, the default first."""
    from pallas_kernels.anchored_attention import budget
    from pallas_kernels.anchored_attention.pallas_triton import TileConfig

    d = TileConfig.default(head_dim, itemsize)
    fwd = [d] + [d.replace(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
                 for bq in (64, 128) for bk in (32, 64, 128) for w in (4, 8) for s in (2, 3)]  # fmt: skip
    bwd = [d] + [d.replace(block_q_bwd=bq, block_k_bwd=bk, num_warps_bwd=w, num_warps_dkdv=wd, num_stages_bwd=s, num_stages_dkdv=s)
                 for bq in (32, 64, 128) for bk in (32, 64, 128) for w in (4, 8) for wd in (4, 8) for s in (1, 2, 3)]  # fmt: skip

    def fits(t, kernels):
        return not any(budget.problems(t, head_dim, groups, itemsize, kernels).values())

    def unique(ts):
        seen, out = set(), []
        for t in ts:
            if t not in seen:
                seen.add(t)
                out.append(t)
        return out

    fwd = [t for t in unique(fwd) if fits(t, ("forward",))][:limit]
    bwd = [t for t in unique(bwd) if fits(t, ("dq", "dkdv"))][:limit]
    return fwd, bwd


def stage_sweep(plan, prior, outdir) -> dict:
    shape = plan["sweep"]
    B, T, A, S, N, K, H, dtype = shape
    itemsize = 2 if dtype == "bfloat16" else 4
    interpret = not on_gpu()
    fwd_c, bwd_c = sweep_candidates(H, N // K, itemsize, plan["sweep_max"])
    deadline = time.perf_counter() + 0.8 * plan["budget_s"] - 10  # leave time to report
    rows = []
    # Forward and backward candidates alternate so that a budget cut short still times some of each.
    kernels_of = {"forward": ("forward",), "backward": ("dq", "dkdv")}
    order = [("forward", t) for t in fwd_c], [("backward", t) for t in bwd_c]
    queue = [c for pair in itertools.zip_longest(*order) for c in pair if c is not None]
    for kind, t in queue:
        kernels = kernels_of[kind]
        if time.perf_counter() > deadline:
            rows.append({"kind": kind, "tiles": t.to_dict(), "status": "not run: stage budget"})
            continue
        row = {"kind": kind, "tiles": t.to_dict()}
        try:
            fns = _kernel_setup(shape, t, interpret)
            ms = 0.0
            for k in kernels:
                compiled, _, _ = compile_once(fns[k][0], *fns[k][1])
                ms += timed_ms(compiled, fns[k][1], plan["repeats"])
            row.update(status="ok", ms=ms)
        except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded
            row.update(status="failed", error=err_text(e))
        rows.append(row)
        print(json.dumps(row)[:300], flush=True)
        progress({"shape": shape_dict(shape), "rows": rows})
    best = {}
    for kind in ("forward", "backward"):
        ok = [r for r in rows if r["kind"] == kind and r["status"] == "ok"]
        if ok:
            best[kind] = min(ok, key=lambda r: r["ms"])
    out = {"shape": shape_dict(shape), "rows": rows}
    if len(best) == 2:
        fwd_fields = ("block_q", "block_k", "num_warps", "num_stages")
        merged = dict(best["backward"]["tiles"])
        merged.update({k: best["forward"]["tiles"][k] for k in fwd_fields})
        out["best_tiles"] = merged
        out["best_ms"] = {k: v["ms"] for k, v in best.items()}
    return out


def stage_train(plan, prior, outdir) -> dict:
    jax = _jax()
    import dataclasses

    from dflash_jax.sharding import MeshConfig
    from dflash_jax.target.config import TargetConfig
    from dflash_jax.tools import flops
    from dflash_jax.tools import plan as plan_lib
    from dflash_jax.training.run_config import load_run_config

    p = plan["train"]
    cfg = load_run_config(
        "qwen3-8b", [f"drafter.num_layers={p['drafter_layers']}", f"train.max_anchors={p['anchors']}"]
    )
    arch = dict(cfg.target.architecture, num_hidden_layers=p["layers"])
    if p.get("tiny"):  # CPU smoke: the same code at toy widths
        arch.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)  # fmt: skip
    tc = TargetConfig.from_hf_dict(arch)
    taps = tuple(range(min(p["layers"], 5)))
    cfg = dataclasses.replace(
        cfg,
        drafter=dataclasses.replace(
            cfg.drafter, target_layer_ids=list(taps), mask_token_id=tc.vocab_size - 1
        ),
    )
    tiles = use_tiles(prior)  # the step's bf16 kernels use the tiles the compile/sweep stages chose
    out = {"target_layers": p["layers"], "drafter_layers": p["drafter_layers"], "rows": p["rows"],
           "seq_len": p["seq"], "anchors": p["anchors"], "tiles": tiles.to_dict() if tiles else None}  # fmt: skip
    peak = peak_tflops(jax.devices()[0].device_kind)
    keys = []
    for run in p["impls"]:  # "impl/dtype": dtype is train.activation_dtype (plain "impl": the config's)
        impl, _, drafter_dtype = run.partition("/")
        train = (
            cfg.train if not drafter_dtype else dataclasses.replace(cfg.train, activation_dtype=drafter_dtype)
        )
        c = dataclasses.replace(
            cfg, train=train, drafter=dataclasses.replace(cfg.drafter, attention_impl=impl)
        )
        spec = plan_lib.spec_for_run(c, target_config=tc, seq_len=p["seq"], batch_rows=p["rows"])
        key = f"{impl}/{spec.drafter_config.compute_dtype}"  # the activations the step really ran in
        keys.append(key)
        try:
            lp = plan_lib.plan_layout(spec, MeshConfig(data=1), jax.devices()[:1], measure_steps=p["steps"])
            # Model FLOPs counted analytically (tools/flops.py, as `bench step` does): XLA's cost
            # analysis counts a Pallas custom call as ~0 and the dense xla path's masked-out work in full.
            tokens, blocks = p["rows"] * p["seq"], p["rows"] * p["anchors"]
            model_flops = flops.train_step_flops(
                tc, spec.drafter_config, context_tokens=tokens, blocks=blocks,
                label_positions=flops.label_positions(cfg.train.loss, tokens, blocks, spec.drafter_config.block_size),
            )  # fmt: skip
            res = {"step_s": lp.step_seconds, "tokens_per_s": lp.tokens_per_second, "compile_s": lp.compile_seconds,
                   "tflops_per_step": model_flops / 1e12, "xla_cost_tflops": lp.flops / 1e12,
                   "peak_gib": lp.peak_bytes / 2**30}  # fmt: skip
            res["model_tflops_per_s"] = model_flops / lp.step_seconds / 1e12
            if peak:
                res["mfu"] = res["model_tflops_per_s"] / peak
        except Exception as e:  # noqa: BLE001
            res = {"error": err_text(e)}
        out[key] = res
        print(key, json.dumps(res), flush=True)
        progress(out)
    if all("error" in out[k] for k in keys):
        raise RuntimeError(f"the training step failed with {keys}: {out[keys[0]]['error']}")
    return out


def _packed_inputs(B, T, N, K, H, dtype, docs):
    """Random q/k/v at [B, T] and segment ids of ``docs`` equal documents a row."""
    jax = _jax()
    import jax.numpy as jnp
    import numpy as np

    key = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key[0], (B, T, N, H)).astype(dtype)
    k = jax.random.normal(key[1], (B, T, K, H)).astype(dtype)
    v = jax.random.normal(key[2], (B, T, K, H)).astype(dtype)
    seg = jnp.asarray(np.repeat((np.arange(T) // max(T // docs, 1) + 1)[None], B, 0), jnp.int32)
    return q, k, v, seg


def _target_fns(B, T, scale, tiles):
    """The target's attention on [B, T] packed rows by impl: the tiled XLA path and the kernel."""
    from dflash_jax.target.attention import attend_xla, self_attention_mask
    from pallas_kernels.segment_attention import segment_attention

    def xla(q, k, v, seg):
        return attend_xla(q, k, v, *self_attention_mask(B, T, seg), scale)

    def pallas(q, k, v, seg):
        return segment_attention(q, k, v, *self_attention_mask(B, T, seg), scale=scale, tiles=tiles)

    return {"xla": xla, "pallas": pallas}


def target_attention_comparison(B, T, N, K, H, dtype, repeats, *, docs=4, tokamax=True, tiles=None) -> dict:
    """The target's causal attention at [B, T] (forward only: the target is frozen) on rows of
    ``docs`` documents: the tiled XLA path, the segment attention kernel (``tiles``; its values
    against XLA's), tokamax on the same rows (``tokamax``), and on a GPU cuDNN
    (``jax.nn.dot_product_attention``) against both on one document a row, the only mask cuDNN's
    top-left causal expresses here."""
    jax = _jax()
    import jax.numpy as jnp

    from pallas_kernels.anchored_attention import tokamax_impl

    q, k, v, seg = _packed_inputs(B, T, N, K, H, dtype, docs)
    scale = H**-0.5
    out = {"shape": dict(B=B, T=T, N=N, K=K, H=H, dtype=dtype, docs_per_row=docs)}
    fns = _target_fns(B, T, scale, tiles)
    compiled = {}
    for impl, fn in fns.items():
        try:
            c, secs, temp = compile_once(fn, q, k, v, seg)
            compiled[impl] = c
            out[impl] = {"ms": timed_ms(c, (q, k, v, seg), repeats), "compile_s": secs, "temp_mib": temp}
        except Exception as e:  # noqa: BLE001 - the other impls still run
            out[impl] = {"error": err_text(e)}
    ref = compiled["xla"](q, k, v, seg) if "xla" in compiled else None
    if "pallas" in compiled and ref is not None:
        out["pallas"]["rel_err_vs_xla"] = _rel_err(compiled["pallas"](q, k, v, seg), ref)
        out["pallas"]["speedup_vs_xla"] = out["xla"]["ms"] / out["pallas"]["ms"]
    if not tokamax:
        pass
    elif tokamax_ok() is None:
        impl = "mosaic" if on_gpu() else "xla"
        fn = lambda q, k, v, seg: tokamax_impl.packed_causal_attention_tokamax(
            q, k, v, seg, scale=scale, implementation=impl
        )
        try:
            c, secs, temp = compile_once(fn, q, k, v, seg)
            out[f"tokamax_{impl}"] = {"ms": timed_ms(c, (q, k, v, seg), repeats), "compile_s": secs,
                                      "temp_mib": temp, "rel_err_vs_xla": _rel_err(c(q, k, v, seg), ref)}  # fmt: skip
        except Exception as e:  # noqa: BLE001
            out[f"tokamax_{impl}"] = {"error": err_text(e)}
    else:
        out["tokamax"] = {"error": tokamax_ok()}
    if on_gpu():
        one = jnp.ones_like(seg)
        fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        try:
            c, secs, _ = compile_once(fn, q, k, v)
            r = {"ms": timed_ms(c, (q, k, v), repeats), "compile_s": secs}
            want = c(q, k, v)
            for impl in compiled:  # each of ours on the one-document rows cuDNN can express
                ours, _, _ = compile_once(fns[impl], q, k, v, one)
                r[f"{impl}_one_doc_ms"] = timed_ms(ours, (q, k, v, one), repeats)
                r[f"{impl}_over_cudnn"] = r[f"{impl}_one_doc_ms"] / r["ms"]
                r[f"{impl}_rel_err_vs_cudnn"] = _rel_err(ours(q, k, v, one), want)
            out["cudnn_one_doc"] = r
        except Exception as e:  # noqa: BLE001
            out["cudnn_one_doc"] = {"error": err_text(e)}
    return out


def target_tile_candidates(head_dim: int, itemsize: int, limit: int):
    """The segment kernel's tile candidates within its budget, the default first."""
    from pallas_kernels.segment_attention.pallas_triton import TileConfig, estimate

    d = TileConfig.default(head_dim, itemsize)
    cands = [d] + [TileConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
                   for bq, bk, w in ((128, 64, 8), (128, 64, 4), (64, 32, 4), (128, 128, 8), (64, 128, 4))
                   for st in (3, 2)]  # fmt: skip
    seen, out = set(), []
    for t in cands:
        if t not in seen and not estimate(t, head_dim, itemsize).problems():
            seen.add(t)
            out.append(t)
    return out[:limit]


def stage_target(plan, prior, outdir) -> dict:
    """The target's attention on packed rows at each of the plan's lengths (Qwen3-8B's heads on a
    GPU): the segment kernel against the tiled XLA path (values and ms) and cuDNN's one-document
    time; then, as time allows, the kernel's tile candidates at the longest length. The kernel is
    ``ok`` where its values match XLA's at every length; ``record`` validates it where it is also
    faster (``pallas_kernels/segment_attention/validated.json``)."""
    p = plan["target"]
    N, K, H = p["heads"]
    deadline = time.perf_counter() + 0.8 * plan["budget_s"] - 5
    tol = 2e-2 if p["dtype"] == "bfloat16" else 1e-4
    out = {"device_kind": _jax().devices()[0].device_kind, "head_dim": H, "groups": N // K,
           "dtype": p["dtype"], "tolerance": tol, "cases": []}  # fmt: skip
    for B, T in p["rows"]:
        case = target_attention_comparison(B, T, N, K, H, p["dtype"], plan["repeats"], tokamax=p["tokamax"])
        out["cases"].append(case)
        print("target", json.dumps(case)[:400], flush=True)
        progress(out)
    errs = [c.get("pallas", {}).get("rel_err_vs_xla") for c in out["cases"]]
    out["pallas_ok"] = all(e is not None and e <= tol for e in errs)
    speedups = [c["pallas"].get("speedup_vs_xla") for c in out["cases"] if "pallas" in c]
    out["speedup_vs_xla"] = min(speedups) if speedups and None not in speedups else None
    # the tile sweep at the longest length, forward alone, while the stage's time lasts
    from pallas_kernels.segment_attention.pallas_triton import TileConfig

    B, T = p["rows"][-1]
    q, k, v, seg = _packed_inputs(B, T, N, K, H, p["dtype"], 4)
    ref = []  # the XLA path's output at that length, made when the first candidate runs
    itemsize = 2 if p["dtype"] == "bfloat16" else 4
    out["default_tiles"] = TileConfig.default(H, itemsize).to_dict()
    sweep = []
    for t in target_tile_candidates(H, itemsize, p["sweep_max"]):
        if time.perf_counter() > deadline:
            sweep.append({"tiles": t.to_dict(), "status": "not run: stage budget"})
            continue
        row = {"tiles": t.to_dict()}
        try:
            fns = _target_fns(B, T, H**-0.5, t)
            if not ref:
                ref.append(compile_once(fns["xla"], q, k, v, seg)[0](q, k, v, seg))
            c, _, _ = compile_once(fns["pallas"], q, k, v, seg)
            err = _rel_err(c(q, k, v, seg), ref[0])
            row.update(ms=timed_ms(c, (q, k, v, seg), plan["repeats"]), rel_err_vs_xla=err)
            row["status"] = "ok" if err <= tol else f"off the XLA path: rel err {err:.2e} > {tol}"
        except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded
            row.update(status="failed", error=err_text(e))
        sweep.append(row)
        progress({**out, "sweep": sweep})
    out["sweep"] = sweep
    ok = [r for r in sweep if r["status"] == "ok"]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        out["best_tiles"], out["best_ms"] = best["tiles"], best["ms"]
    if not out["pallas_ok"]:
        raise StageFailed(f"the segment attention kernel is off the XLA path: rel err {errs} > {tol}", out)
    return out


class _AutoChoice:
    """Collects a kernel dispatch's ``attention_impl=auto: using ...`` lines (logged once each):
    the drafter's (``anchored_attention``) or the target's (``segment_attention``)."""

    def __init__(self, kernel: str = "anchored_attention"):
        import logging

        self.lines = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda rec: self.lines.append(rec.getMessage())
        log = logging.getLogger(f"pallas_kernels.{kernel}.api")
        log.setLevel(logging.INFO)
        log.addHandler(handler)


def _full_run_config(p: dict):
    """qwen3-8b's run config (configs/qwen3-8b.yaml) at the stage's sizes, and its target config."""
    import dataclasses

    from dflash_jax.target.config import TargetConfig
    from dflash_jax.training.run_config import load_run_config

    cfg = load_run_config(
        "qwen3-8b",
        [
            f"drafter.num_layers={p['drafter_layers']}",
            f"drafter.block_size={p['block_size']}",
            f"drafter.draft_vocab_size={p['draft_vocab']}",
            f"train.max_anchors={p['anchors']}",
            f"data.max_length={p['seq']}",
        ],
    )
    arch = dict(cfg.target.architecture, num_hidden_layers=p["target_layers"])
    if p.get("tiny"):  # CPU smoke: the same stage at toy widths
        arch.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)  # fmt: skip
        drafter = dataclasses.replace(cfg.drafter, mask_token_id=511, target_layer_ids=list(p["taps"]))
        cfg = dataclasses.replace(cfg, drafter=drafter)
    return cfg, TargetConfig.from_hf_dict(arch)


def stage_full(plan, prior, outdir) -> dict:
    """The trainer's own step (training/step.py's ``jit_train_step``, lowered by tools/plan.py on
    the planner's abstract shapes) at full size on one device. Weights and optimizer state are
    random, made on the device at their real shapes (``tools.plan``'s measurement: one jitted
    initialiser with the leaves' shardings); the rows are the planner's packed rows of 4 documents.
    A variant whose compiled plan exceeds the device's memory pool is recorded and not run."""
    jax = _jax()
    import dataclasses

    from dflash_jax.sharding import MeshConfig, make_mesh
    from dflash_jax.tools import flops
    from dflash_jax.tools import plan as plan_lib

    t_start = time.perf_counter()
    p = plan["full"]
    deadline = t_start + plan["budget_s"] - 10  # leave time to write the result
    cfg, tc = _full_run_config(p)
    tiles = use_tiles(prior)  # for a forced `pallas`; `auto` takes validated.json's tiles
    auto, target_auto = _AutoChoice(), _AutoChoice("segment_attention")
    device = jax.devices()[0]
    peak = peak_tflops(device.device_kind)
    limit = plan_lib.device_memory_limit([device])
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), [device])
    out = {"device_kind": device.device_kind, "target_layers": tc.num_layers, "hidden": tc.hidden_size,
           "vocab": tc.vocab_size, "draft_vocab": p["draft_vocab"], "drafter_layers": p["drafter_layers"],
           "block_size": p["block_size"], "seq_len": p["seq"], "anchors_per_row": p["anchors"],
           "target_dtype": cfg.target.dtype, "loss": cfg.train.loss, "peak_tflops": peak,
           "memory_pool_gib": None if limit is None else limit / 2**30,
           "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
           "tiles": tiles.to_dict() if tiles else None, "variants": []}  # fmt: skip
    first_s = None
    for impl, rows in p["variants"]:
        row = {"attention_impl": impl, "rows": rows}
        out["variants"].append(row)
        if impl == "pallas" and all(
            any("using 'pallas'" in line for line in a.lines) for a in (auto, target_auto)
        ):
            row["status"] = "skipped: auto already runs pallas (drafter and target)"
            continue
        left = deadline - time.perf_counter() - (0 if first_s is None else 15)  # 15 s: the attention part
        if first_s is not None and left < 1.2 * first_s:
            row["status"] = (
                f"skipped: {left:.0f} s left of the stage budget, the first variant took {first_s:.0f} s"
            )
            continue
        v0 = time.perf_counter()
        try:
            c = dataclasses.replace(  # `pallas` forces both kernels: the drafter's and the target's
                cfg,
                drafter=dataclasses.replace(cfg.drafter, attention_impl=impl),
                target=dataclasses.replace(cfg.target, attention_impl=impl),
            )
            spec = plan_lib.spec_for_run(c, target_config=tc, seq_len=p["seq"], batch_rows=rows)
            row["drafter_compute_dtype"] = spec.drafter_config.compute_dtype
            row["drafter_matmul_dtype"] = spec.drafter_config.matmul_dtype
            with jax.set_mesh(mesh):
                t_graph, t_state = plan_lib.abstract_target(spec, mesh)
                d_graph, d_state = plan_lib.abstract_drafter_and_optimizer(spec, mesh)
                batch = plan_lib.abstract_batch(spec, mesh)
                key = plan_lib.abstract_key(mesh)
                c0 = time.perf_counter()
                lowered = plan_lib.lower_train_step(spec, d_graph, d_state, t_graph, t_state, batch, key)
                # CPU smoke: tiny shapes run fast unoptimised, and LLVM's expensive passes are most of its compile
                cpu_opts = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
                compiled = lowered.compile(compiler_options=None if on_gpu() else cpu_opts)
            row["compile_s"] = time.perf_counter() - c0
            m = compiled.memory_analysis()
            if m is not None:
                plan_peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                             + m.temp_size_in_bytes)  # fmt: skip
                row["plan_peak_gib"] = plan_peak / 2**30
                if limit is not None and plan_peak > limit:
                    row["status"] = (f"does not fit: the compiled step needs {plan_peak / 2**30:.1f} GiB, "
                                     f"the pool holds {limit / 2**30:.1f} GiB")  # fmt: skip
                    continue
            step_s = plan_lib._measure(compiled, spec, mesh, t_state, d_state, p["steps"])
            tokens, blocks = rows * p["seq"], rows * p["anchors"]
            model_flops = flops.train_step_flops(
                tc, spec.drafter_config, context_tokens=tokens, blocks=blocks,
                label_positions=flops.label_positions(cfg.train.loss, tokens, blocks, spec.drafter_config.block_size),
            )  # fmt: skip
            row.update(status="ok", ms_per_step=1e3 * step_s, tokens_per_s=tokens / step_s,
                       anchors_per_s=blocks / step_s, tflops_per_step=model_flops / 1e12,
                       model_tflops_per_s=model_flops / step_s / 1e12)  # fmt: skip
            if peak:
                row["mfu"] = row["model_tflops_per_s"] / peak
            stats = device.memory_stats() or {}
            if "peak_bytes_in_use" in stats:  # the process's peak so far: this variant's or an earlier one's
                row["device_peak_gib"] = stats["peak_bytes_in_use"] / 2**30
        except Exception as e:  # noqa: BLE001 - recorded (out of memory included); the next variant runs
            row.update(status="failed", error=err_text(e))
        finally:
            row["seconds"] = time.perf_counter() - v0
            first_s = row["seconds"] if first_s is None else first_s
            print("full", json.dumps(row)[:400], flush=True)
            progress(out)
        if impl == "auto" and auto.lines:
            out["auto_choice"] = auto.lines[0]
        if impl == "auto" and target_auto.lines:
            out["target_auto_choice"] = target_auto.lines[0]
        # the target's attention at the step's shape, once one variant has run
        if "target_attention" not in out and row.get("status") == "ok":
            try:
                out["target_attention"] = target_attention_comparison(
                    rows, p["seq"], tc.num_heads, tc.num_kv_heads, tc.head_dim, cfg.target.dtype,
                    plan["repeats"], tokamax=False,
                )  # fmt: skip
                for impl in ("xla", "pallas"):
                    ms = out["target_attention"].get(impl, {}).get("ms")
                    if ms is not None:
                        out["target_attention"][f"{impl}_ms_x_layers"] = ms * tc.num_layers
            except Exception as e:  # noqa: BLE001
                out["target_attention"] = {"error": err_text(e)}
            progress(out)
    if not any(r.get("status") == "ok" for r in out["variants"]):
        raise StageFailed(f"no full-size variant ran: {[r.get('status') for r in out['variants']]}", out)
    return out


STAGE_FNS = {
    "env": stage_env,
    "compile": stage_compile,
    "correctness": stage_correctness,
    "speed": stage_speed,
    "sweep": stage_sweep,
    "target": stage_target,
    "full": stage_full,
    "train": stage_train,
}


_PROGRESS: list = []  # [state file] of the stage running in this process


def progress(result: dict) -> None:
    """Write a stage's partial result: a stage killed at its budget keeps what it measured."""
    if _PROGRESS:
        _PROGRESS[0].write_text(json.dumps({"status": "running", "result": result}, indent=1, default=str))


def run_stage(name: str, smoke: bool, state_dir: Path, budget_s: float) -> int:
    """In the stage's own process: run it, write state_dir/NAME.json."""
    _PROGRESS[:] = [state_dir / f"{name}.json"]
    plan = dict(SMOKE if smoke else FULL, budget_s=budget_s)
    prior = {p.stem: json.loads(p.read_text()) for p in state_dir.glob("*.json")}
    inject = os.environ.get("GPU_CHECK_INJECT", "")
    t0 = time.perf_counter()
    try:
        if not smoke and not on_gpu():
            raise RuntimeError(f"no GPU backend (jax sees {_jax().devices()}); use --cpu-smoke on CPU")
        for item in filter(None, inject.split(",")):
            stage, _, how = item.partition(":")
            if stage == name and how == "hang":
                time.sleep(10**6)
            if stage == name:
                raise RuntimeError(f"injected failure in stage {name!r} (GPU_CHECK_INJECT)")
        record = {"status": "ok", "result": STAGE_FNS[name](plan, prior, state_dir)}
    except Exception as e:  # noqa: BLE001 - recorded; the orchestrator goes on
        traceback.print_exc()
        record = {"status": "failed", "error": err_text(e)}
        if isinstance(e, StageFailed):
            record["result"] = e.result
    record["seconds"] = time.perf_counter() - t0
    (state_dir / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    return 0 if record["status"] == "ok" else 1


# ---------------------------------------------------------------------------------- orchestrator


def markdown(report: dict) -> str:
    env = report["stages"].get("env", {}).get("result", {})
    lines = [f"### GPU check: {env.get('device_kind', '?')}, jax {env.get('jax', '?')}"
             f"{' (CPU smoke)' if report['cpu_smoke'] else ''}", "",
             "| stage | status | s | note |", "|---|---|---|---|"]  # fmt: skip
    for name in report["order"]:
        s = report["stages"].get(name, {})
        note = s.get("error", "")[:160].replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {s.get('status', 'not run')} | {s.get('seconds', 0):.0f} | {note} |")

    def res(name):
        return report["stages"].get(name, {}).get("result") or {}

    if res("compile").get("tiles"):
        lines += ["", f"compile: chosen tiles `{json.dumps(res('compile')['tiles'])}`"]
    cases = res("correctness").get("cases", [])
    if cases:
        lines += [
            "",
            "| case | dtype | impl | max rel err (out, lse, dq, dk, dv) | ok |",
            "|---|---|---|---|---|",
        ]
        for r in cases:
            errs = (
                ", ".join(f"{r['rel_err'][k]:.1e}" for k in ("out", "lse", "dq", "dk", "dv"))
                if "rel_err" in r
                else r.get("error", "")[:80]
            )
            lines.append(
                f"| {r['case']} | {r['dtype']} | {r['impl']} | {errs} | {'yes' if r['ok'] else 'NO'} |"
            )
    sp = res("speed")
    if sp:
        s = sp["shape"]
        lines += ["", f"speed at B={s['B']} T={s['T']} A={s['A']} S={s['S']} N/K={s['N']}/{s['K']} d={s['H']} {s['dtype']} "
                  f"(visible {sp['visible_fraction']:.3f}, pallas computes {sp['computed_fraction']:.3f}):", "",
                  "| impl | fwd ms | fwd+bwd ms | fwd+bwd temp MiB | vs xla |", "|---|---|---|---|---|"]  # fmt: skip
        for impl in ("xla", "pallas", "tokamax"):
            r = sp.get(impl)
            if r is None:
                continue

            def f(key, fmt=".2f", r=r):
                return format(r[key], fmt) if r.get(key) is not None else "-"

            err = r.get("fwd_error") or r.get("fwd_bwd_error") or ""
            lines.append(f"| {impl} | {f('fwd_ms')} | {f('fwd_bwd_ms')} | {f('fwd_bwd_temp_mib', '.0f')} | "
                         f"{f('speedup_vs_xla')} {err[:80]} |")  # fmt: skip
    sw = res("sweep")
    if sw.get("best_tiles"):
        lines += ["", f"sweep: best `{json.dumps(sw['best_tiles'])}` ({json.dumps(sw['best_ms'])} ms)"]
    tr = res("train")
    if tr:
        lines += ["", f"train step (qwen3-8b, {tr['target_layers']} target / {tr['drafter_layers']} drafter layers, "
                  f"{tr['rows']} x {tr['seq_len']} tokens, {tr['anchors']} anchors):", ""]  # fmt: skip
        for impl in [k for k in tr if k.partition("/")[0] in ("pallas", "xla")]:
            r = tr[impl]
            label = impl if "/" in impl else f"{impl}/float32"  # older checks: plain = float32 activations
            if "error" in r:
                lines.append(f"- {label}: error {r['error'][:300]}")
            elif r:
                mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
                lines.append(
                    f"- {label}: {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s{mfu}"
                )
    lines += target_markdown(res("target"))
    lines += full_markdown(res("full"))
    lines += ["", f"total {report['seconds']:.0f} s"]
    return "\n".join(lines) + "\n"


def target_markdown(tg: dict) -> list[str]:
    """The target stage's lines: per length, the XLA path, the segment kernel and cuDNN's one document."""
    if not tg.get("cases"):
        return []
    lines = ["", f"target attention (forward, packed rows of 4 documents, {tg['cases'][0]['shape']['N']}/"
             f"{tg['cases'][0]['shape']['K']} heads, d={tg['head_dim']}, {tg['dtype']}; the kernel "
             f"{'matches' if tg.get('pallas_ok') else 'does NOT match'} XLA within {tg['tolerance']:g}):", "",
             "| rows x T | xla ms | pallas ms | pallas vs xla | pallas rel err | cuDNN 1-doc ms | xla 1-doc ms | "
             "pallas 1-doc ms | pallas / cuDNN |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in tg["cases"]:
        s, x, pa, cu = c["shape"], c.get("xla", {}), c.get("pallas", {}), c.get("cudnn_one_doc", {})
        err = pa.get("error") or x.get("error") or cu.get("error") or ""
        lines.append(f"| {s['B']} x {s['T']} | {_fmt(x.get('ms'), '.2f')} | {_fmt(pa.get('ms'), '.2f')} | "
                     f"{_fmt(pa.get('speedup_vs_xla'), '.2f')} | {_fmt(pa.get('rel_err_vs_xla'), '.1e')} | "
                     f"{_fmt(cu.get('ms'), '.2f')} | {_fmt(cu.get('xla_one_doc_ms'), '.2f')} | "
                     f"{_fmt(cu.get('pallas_one_doc_ms'), '.2f')} | {_fmt(cu.get('pallas_over_cudnn'), '.2f')} "
                     f"{err[:80].replace('|', '/')} |")  # fmt: skip
    for c in tg["cases"]:
        for k, r in c.items():
            if k.startswith("tokamax"):
                s = c["shape"]
                lines.append(
                    f"\n{k} at {s['B']} x {s['T']}: "
                    + (f"{r['ms']:.2f} ms" if "ms" in r else r.get("error", "")[:160])
                )
    if tg.get("best_tiles"):
        lines += ["", f"target sweep: best `{json.dumps(tg['best_tiles'])}` ({tg['best_ms']:.2f} ms; default "
                  f"`{json.dumps(tg['default_tiles'])}`)"]  # fmt: skip
    return lines


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def full_markdown(fu: dict) -> list[str]:
    """The full-size stage's lines: one row per variant, the `auto` choice, the target's attention."""
    if not fu.get("variants"):
        return []
    pool = f", pool {fu['memory_pool_gib']:.1f} GiB" if fu.get("memory_pool_gib") else ""
    dtypes = {(r.get("drafter_compute_dtype"), r.get("drafter_matmul_dtype")) for r in fu["variants"]}
    lines = ["", f"full-size step on one {fu['device_kind']} (qwen3-8b: {fu['target_layers']} target layers in "
             f"{fu['target_dtype']}, random weights; {fu['drafter_layers']}-layer drafter, B={fu['block_size']}, "
             f"drafter compute/matmul dtype {', '.join(f'{a}/{b}' for a, b in sorted(dtypes, key=str) if a)}; "
             f"T={fu['seq_len']}, {fu['anchors_per_row']} anchors a row, {fu['loss']} labels over the "
             f"{fu['vocab']}-token vocabulary, {fu['draft_vocab']}-token draft vocabulary{pool}; "
             f"MFU over {_fmt(fu.get('peak_tflops'), '.0f')} TFLOP/s):", "",
             "| attention | rows | ms/step | tokens/s | anchors/s | TFLOP/step | MFU | plan peak GiB | device peak GiB | compile s | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in fu["variants"]:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        status = (r.get("error") or r.get("status", "not run"))[:120].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['attention_impl']} | {r['rows']} | {_fmt(r.get('ms_per_step'))} | "
                     f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('anchors_per_s'), '.0f')} | "
                     f"{_fmt(r.get('tflops_per_step'))} | {mfu} | {_fmt(r.get('plan_peak_gib'))} | "
                     f"{_fmt(r.get('device_peak_gib'))} | {_fmt(r.get('compile_s'), '.0f')} | {status} |")  # fmt: skip
    if fu.get("auto_choice"):
        lines += ["", f"`auto`: {fu['auto_choice']}"]
    if fu.get("target_auto_choice"):
        lines += ["", f"target `auto`: {fu['target_auto_choice']}"]
    ta = fu.get("target_attention") or {}
    if "shape" in ta:
        s = ta["shape"]
        per = [f"{impl} {ta[impl]['ms']:.2f} ms (x {fu['target_layers']} layers: {ta[impl + '_ms_x_layers']:.0f} ms)"
               if "ms" in ta.get(impl, {}) else f"{impl}: {ta.get(impl, {}).get('error', 'not run')[:120]}"
               for impl in ("xla", "pallas")]  # fmt: skip
        text = (f"target attention at the step's shape ({s['B']} x {s['T']}, {s['N']}/{s['K']} heads, d={s['H']}, "
                f"{s['dtype']}, forward) on {s['docs_per_row']} documents a row: {'; '.join(per)}")  # fmt: skip
        cu = ta.get("cudnn_one_doc") or {}
        if "ms" in cu:
            ours = ", ".join(f"{i} {cu[i + '_one_doc_ms']:.2f} ms ({i} / cuDNN {cu[i + '_over_cudnn']:.2f})"
                             for i in ("xla", "pallas") if i + "_one_doc_ms" in cu)  # fmt: skip
            text += f"; one document a row: cuDNN {cu['ms']:.2f} ms, {ours}"
        elif "error" in cu:
            text += f"; cuDNN: {cu['error'][:160]}"
        lines += ["", text]
    elif "error" in ta:
        lines += ["", f"target attention: {ta['error'][:200]}"]
    return lines


def orchestrate(outdir: Path, smoke: bool, stages, budget_scale: float, total_s: float, budgets=None) -> dict:
    outdir.mkdir(parents=True, exist_ok=True)
    budgets = {**(SMOKE_BUDGET_S if smoke else BUDGET_S), **(budgets or {})}
    report = {"cpu_smoke": smoke, "order": list(stages), "stages": {}, "seconds": 0.0}
    t0 = time.perf_counter()
    log = open(outdir / "gpu_check.log", "a")

    def save():
        report["seconds"] = time.perf_counter() - t0
        (outdir / "result.json").write_text(json.dumps(report, indent=1, default=str))
        (outdir / "gpu_check.md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as state:
        state_dir = Path(state)
        for name in stages:
            budget_s = budgets[name] * budget_scale
            left = total_s - (time.perf_counter() - t0)
            if left < min(budget_s, 15):
                report["stages"][name] = {
                    "status": "skipped",
                    "error": f"{left:.0f} s left of the run's {total_s:.0f} s",
                }
                save()
                continue
            budget_s = min(budget_s, left)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--run-stage", name, "--state", state,
                   "--budget", str(budget_s)] + (["--cpu-smoke"] if smoke else [])  # fmt: skip
            log.write(f"\n===== {name} (budget {budget_s:.0f} s) =====\n")
            log.flush()
            s0 = time.perf_counter()
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if name == "full":  # one device holds Qwen3-8B, its drafter and the step: a larger pool
                env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", FULL_MEM_FRACTION)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                proc.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            piece = state_dir / f"{name}.json"
            rec = json.loads(piece.read_text()) if piece.exists() else {}
            if proc.returncode == -9 and rec.get("status") in (None, "running"):  # not done at its budget
                rec.update(
                    status="timeout", error=f"killed at its {budget_s:.0f} s budget (results so far kept)"
                )
            elif rec.get("status") in (None, "running"):
                rec.update(status="crashed", error=f"exit code {proc.returncode} (see gpu_check.log)")
            report["stages"][name] = rec
            report["stages"][name].setdefault("seconds", time.perf_counter() - s0)
            print(
                f"[{time.perf_counter() - t0:5.0f}s] {name}: {report['stages'][name]['status']}", flush=True
            )
            save()
    log.close()
    return report


def record(
    outdir: Path,
    validated_path: Path | None = None,
    benchmarks: Path | None = None,
    segment_validated_path: Path | None = None,
) -> list[dict]:
    """After a GPU run: validated.json gets an entry, keyed by the device kind the check ran on,
    for the kernel that passed every correctness case and beat xla fwd+bwd at the speed shape
    (entries of other kinds stay); the segment kernel's validated.json one where the ``target``
    stage found it equal to the XLA path at every length and faster at each; BENCHMARKS.md's GPU
    section gets the markdown of ``result.json`` (every stage's numbers, the full-size step's
    included). Returns the entries written."""
    from pallas_kernels.anchored_attention import validated
    from pallas_kernels.segment_attention import validated as segment_validated

    report = json.loads((outdir / "result.json").read_text())
    if report.get("cpu_smoke"):
        raise SystemExit("record: a --cpu-smoke result validates nothing")
    st = report["stages"]
    env, corr, speed = (st.get(k, {}).get("result") or {} for k in ("env", "correctness", "speed"))
    rows = []
    if speed:
        s = speed["shape"]
        base = dict(device_kind=env["device_kind"], head_dim=s["H"], groups=s["N"] // s["K"], dtype=s["dtype"],
                    window=False, jax=env["jax"], date=time.strftime("%Y-%m-%d"))  # fmt: skip
        tiles = (st.get("sweep", {}).get("result") or {}).get("best_tiles") or speed.get("tiles")
        cand = []
        if corr.get("pallas_ok") and speed.get("pallas", {}).get("speedup_vs_xla", 0) > 1:
            cand.append(
                dict(base, impl="pallas", tiles=tiles, speedup_vs_xla=speed["pallas"]["speedup_vs_xla"])
            )
        if (
            corr.get("tokamax_ran")
            and corr.get("tokamax_ok")
            and speed.get("tokamax", {}).get("speedup_vs_xla", 0) > 1
        ):
            cand.append(
                dict(base, impl="tokamax", tiles=None, speedup_vs_xla=speed["tokamax"]["speedup_vs_xla"])
            )
        if cand:
            rows = [max(cand, key=lambda r: r["speedup_vs_xla"])]
            validated.write(rows, validated_path or validated.TABLE_PATH)
    tg = st.get("target", {})
    res = tg.get("result") or {}
    if tg.get("status") == "ok" and res.get("pallas_ok") and (res.get("speedup_vs_xla") or 0) > 1:
        entry = dict(device_kind=res["device_kind"], head_dim=res["head_dim"], groups=res["groups"],
                     dtype=res["dtype"], tiles=res.get("best_tiles") or res.get("default_tiles"),
                     speedup_vs_xla=res["speedup_vs_xla"], jax=env.get("jax"), date=time.strftime("%Y-%m-%d"),
                     lengths=[c["shape"]["T"] for c in res["cases"]])  # fmt: skip
        segment_validated.write([entry], segment_validated_path or segment_validated.TABLE_PATH)
        rows.append(entry)
    bench = benchmarks or ROOT / "BENCHMARKS.md"
    text = bench.read_text()
    if BENCH_BEGIN in text and BENCH_END in text:
        head, rest = text.split(BENCH_BEGIN, 1)
        _, tail = rest.split(BENCH_END, 1)
        md = markdown(report)
        bench.write_text(f"{head}{BENCH_BEGIN}\n{md}{BENCH_END}{tail}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path, nargs="?")
    p.add_argument("--cpu-smoke", action="store_true", help="every stage at tiny sizes on CPU")
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES), help=f"comma-separated subset of {STAGES}")
    p.add_argument("--inject-failure", default="", help="STAGE[:hang],...: make stages fail (tests)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage's budget")
    p.add_argument("--budgets", default="", help="STAGE=SECONDS,...: override stage budgets")
    p.add_argument(
        "--total", type=float, help=f"seconds for the whole run ({TOTAL_S}, smoke {SMOKE_TOTAL_S})"
    )
    p.add_argument("--record", action="store_true", help="write validated.json + BENCHMARKS.md from OUTDIR")
    p.add_argument("--run-stage", help=argparse.SUPPRESS)
    p.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_stage:  # exit at once: the stage's result is written, runtime teardown can be slow
        code = run_stage(args.run_stage, args.cpu_smoke, args.state, args.budget)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if args.outdir is None:
        p.error("OUTDIR is required")
    if args.record:
        print(json.dumps(record(args.outdir), indent=1))
        return 0
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stages {unknown}; expected a subset of {STAGES}")
    if args.inject_failure:
        os.environ["GPU_CHECK_INJECT"] = args.inject_failure
    total = args.total or (SMOKE_TOTAL_S if args.cpu_smoke else TOTAL_S)
    budgets = {k: float(v) for k, v in (item.split("=") for item in args.budgets.split(",") if item)}
    if set(budgets) - set(STAGES):
        p.error(f"--budgets names unknown stages {sorted(set(budgets) - set(STAGES))}")
    report = orchestrate(args.outdir, args.cpu_smoke, stages, args.budget_scale, total, budgets)
    print((args.outdir / "gpu_check.md").read_text())
    return 0 if all(report["stages"][s]["status"] == "ok" for s in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
