"""Benchmarks (timings live here and in BENCHMARKS.md, never in tests).

python -m dflash_jax.bench step [--config tiny] [--steps 10] [key=value ...]
    training-step throughput: tokens/s/device, drafter blocks/s, step time and MFU, with
    the compile step excluded
python -m dflash_jax.bench attention [--rows 2 --length 2048 --anchors 64 --block 16 --docs 4]
    anchored block attention, forward+backward, per implementation (reference | xla | pallas;
    pallas in interpret mode off GPU): time, compiled temp memory, the fraction of the dense
    [A*S, T] context scores computed vs the fraction the mask lets through
python -m dflash_jax.bench generate [--target smollm2] [--batch 32 --prompt 128 --new 128]
    KV-cache generation tokens/s
python -m dflash_jax.bench compare {target,matmuls,drafter-step,eval,attention,all} [--small]
    ours vs the PyTorch reference side by side (``dflash_jax.tools.bench_compare``)
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.cli import cli
from dflash_jax.dtypes import COMPUTE_DTYPE_NAMES, to_dtype
from dflash_jax.tools import flops


def _timeit(fn, repeats):
    out = fn()
    jax.block_until_ready(out)  # compile + warm-up, excluded
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats


def bench_step(args) -> dict:
    from dflash_jax.tools.plan import check_run_fits
    from dflash_jax.training.run import run
    from dflash_jax.training.run_config import load_run_config

    overrides = [
        f"train.steps={args.steps + 1}",
        "train.log_every=1",
        "train.checkpoint_every=100000",
        f"output_dir={args.out}",
        *args.overrides,
    ]
    cfg = load_run_config(args.config, overrides)
    res = run(cfg, quiet=True, preflight=check_run_fits)
    rows = [json.loads(x) for x in open(f"{res['run_dir']}/metrics.jsonl")]
    train = [r for r in rows if r["split"] == "train"][1:]  # step 1 includes the compile
    step_time = float(np.median([r["step_time_s"] for r in train]))
    tokens = float(np.median([r["tokens"] for r in train]))
    anchors = float(np.median([r["anchors"] for r in train]))
    dcfg = res["drafter"].config
    step_flops = flops.train_step_flops(
        res["target"].config,
        dcfg,
        context_tokens=tokens,
        blocks=anchors,
        label_positions=flops.label_positions(cfg.train.loss, tokens, anchors, dcfg.block_size),
        target_forward=not cfg.data.features,
    )
    n_dev = jax.device_count()
    out = {
        "config": args.config,
        "overrides": args.overrides,
        "devices": n_dev,
        "backend": jax.default_backend(),
        "step_time_s": step_time,
        "tokens_per_s_per_device": tokens / step_time / n_dev,
        "blocks_per_s": anchors / step_time,
        "model_tflops_per_s_per_device": step_flops / step_time / n_dev / 1e12,
    }
    if args.peak_tflops:
        out["mfu"] = out["model_tflops_per_s_per_device"] / args.peak_tflops
    return out


def attention_inputs(R, T, A, S, N, K, H, *, docs=4, dtype="float32", seed=0):
    """Packed rows of ``docs`` equal documents with ``A`` sorted anchors drawn inside them (the
    training layout: an anchor a has a+1 in its document); q/k/v random in ``dtype``."""
    from dflash_jax.drafter.masks import AnchoredMask

    rng = np.random.default_rng(seed)
    doc_len = max(T // docs, 2)
    idx = np.arange(T)
    seg = np.minimum(idx // doc_len, docs - 1) + 1
    pos = idx - (seg - 1) * doc_len
    candidates = np.flatnonzero(np.r_[seg[1:] == seg[:-1], False])
    anchors = np.sort(np.stack([rng.choice(candidates, A, replace=A > len(candidates)) for _ in range(R)]), 1)
    mask = AnchoredMask.for_packed_rows(
        jnp.asarray(np.broadcast_to(seg, (R, T)), jnp.int32),
        jnp.asarray(np.broadcast_to(pos, (R, T)), jnp.int32),
        jnp.asarray(anchors, jnp.int32),
        jnp.ones((R, A), bool),
        S,
    )
    key = jax.random.split(jax.random.key(seed), 3)
    dt = jnp.dtype(dtype)
    q = jax.random.normal(key[0], (R, A, S, N, H)).astype(dt)
    k_ctx, v_ctx = jax.random.normal(key[1], (2, R, T, K, H)).astype(dt)
    k_blk, v_blk = jax.random.normal(key[2], (2, R, A, S, K, H)).astype(dt)
    return (q, k_ctx, v_ctx, k_blk, v_blk), mask


def visible_fraction(mask) -> float:
    """Fraction of the dense ``[A*S, T]`` context scores the mask lets through (no window)."""
    seg = np.asarray(mask.ctx_segment_ids)
    anchors, anchor_seg = np.asarray(mask.anchors), np.asarray(mask.anchor_segment_ids)
    T = seg.shape[1]
    seen = 0
    for b in range(seg.shape[0]):  # per row: [A, T] bools, never [A*S, T]
        vis = (seg[b][None, :] == anchor_seg[b][:, None]) & (np.arange(T)[None, :] < anchors[b][:, None])
        seen += int((vis & (anchor_seg[b][:, None] != 0)).sum())
    return seen / (anchors.size * T)


def pallas_computed_fraction(mask, head_dim: int, tiles=None) -> float:
    """Fraction of the dense ``[A*S, T]`` context scores the Pallas forward computes."""
    from pallas_kernels.anchored_attention.pallas_triton import TileConfig
    from pallas_kernels.anchored_attention.tile_tables import computed_fraction, query_tiles

    t = TileConfig.default(head_dim) if tiles is None else tiles
    R, A, S = mask.slot_positions.shape
    T = mask.ctx_segment_ids.shape[1]
    n_q = -(-A * S // t.block_q)
    qt = query_tiles(
        mask.ctx_segment_ids, mask.anchors, mask.anchor_segment_ids, slots=S, block_q=t.block_q,
        block_k=t.block_k, n_q_tiles=n_q, window=None,
    )  # fmt: skip
    unmasked = float(jnp.sum(qt.f1 - qt.f0) / jnp.maximum(jnp.sum(qt.hi - qt.lo), 1))
    frac = computed_fraction(qt, block_q=t.block_q, block_k=t.block_k, num_queries=A * S, num_keys=T)
    return float(jnp.mean(frac)), unmasked


def measure_attention(impl, inputs, mask, *, repeats: int, anchor_chunk: int = 16) -> dict:
    """Forward+backward of the whole anchored attention (context + in-block) with ``impl``:
    mean time (compile excluded) and the compiled temp memory."""
    from dflash_jax.drafter.attention import anchored_attention

    def loss(q, kc, vc, kb, vb, mask):
        o = anchored_attention(
            q, kc, vc, kb, vb, mask, causal=False, window=None, impl=impl, anchor_chunk=anchor_chunk
        )
        return jnp.sum(o.astype(jnp.float32) ** 2)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    try:
        mem = f.lower(*inputs, mask).compile().memory_analysis()
        out = {"fwd_bwd_ms": 1e3 * _timeit(lambda: f(*inputs, mask), repeats)}
        out["temp_mib"] = mem.temp_size_in_bytes / 2**20
    except Exception as e:  # noqa: BLE001 - report an impl that cannot run here
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def bench_attention(args) -> dict:
    from pallas_kernels.anchored_attention import resolve_impl

    R, T, A, S, N, K, H = (
        args.rows,
        args.length,
        args.anchors,
        args.block,
        args.heads,
        args.kv_heads,
        args.head_dim,
    )
    inputs, mask = attention_inputs(R, T, A, S, N, K, H, docs=args.docs, dtype=args.dtype)
    pallas_frac, pallas_unmasked = pallas_computed_fraction(mask, H)
    out = {
        "backend": jax.default_backend(),
        "shape": dict(rows=R, length=T, anchors=A, block=S, heads=N, kv_heads=K, head_dim=H),
        "dtype": args.dtype,
        "docs_per_row": args.docs,
        "visible_fraction": visible_fraction(mask),
    }
    for impl in args.impls:
        resolved = resolve_impl(impl, head_dim=H, groups=N // K, dtype=args.dtype, window=None)
        out[impl] = measure_attention(impl, inputs, mask, repeats=args.repeats)
        out[impl]["computed_fraction"] = pallas_frac if resolved == "pallas" else 1.0
        if resolved == "pallas":
            out[impl]["mask_free_tile_share"] = pallas_unmasked
            out[impl]["interpret"] = jax.default_backend() not in ("gpu", "cuda")
    return out


def bench_generate(args) -> dict:
    import dflash_jax
    from convert.smollm2 import smollm2_dir
    from dflash_jax.decoding.generate import generate

    path = smollm2_dir() if args.target == "smollm2" else args.target
    target = dflash_jax.load_target(path, dtype=args.dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 1000, size=args.prompt).tolist() for _ in range(args.batch)]
    generate(target, prompts, max_new_tokens=args.new, batch_size=args.batch)  # compile
    t0 = time.perf_counter()
    generate(target, prompts, max_new_tokens=args.new, batch_size=args.batch)
    dt = time.perf_counter() - t0
    return {
        "target": str(path),
        "batch": args.batch,
        "prompt": args.prompt,
        "new_tokens": args.new,
        "seconds": dt,
        "generated_tokens_per_s": args.batch * args.new / dt,
    }


def bench_loss(args) -> dict:
    from dflash_jax.training.loss import chunked_token_loss

    dh, th = jax.random.normal(jax.random.key(0), (2, args.slots, args.hidden))
    w = jax.random.normal(jax.random.key(1), (args.hidden, args.vocab)) * 0.05
    out = {"slots": args.slots, "hidden": args.hidden, "vocab": args.vocab, "chunk": args.chunk}
    for name in COMPUTE_DTYPE_NAMES:
        dt = to_dtype(name)
        f = jax.jit(
            jax.grad(
                lambda d, dt=dt: jnp.mean(chunked_token_loss(d, th, w, chunk=args.chunk, compute_dtype=dt)[0])
            )
        )
        out[f"{name}_fwd_bwd_s"] = _timeit(lambda f=f: f(dh), args.repeats)
    return out


def bench_target(args) -> dict:
    from flax import nnx

    import dflash_jax
    from convert.smollm2 import smollm2_dir

    path = smollm2_dir() if args.target == "smollm2" else args.target
    out = {"target": str(path), "rows": args.rows, "length": args.length}
    x = jnp.ones((args.rows, args.length), jnp.int32)
    for dt in COMPUTE_DTYPE_NAMES:
        t = dflash_jax.load_target(path, dtype=dt)
        taps = (1, t.config.num_layers - 3)
        f = nnx.jit(lambda m, x, taps=taps: m(x, layer_ids=taps, return_logits=False).features)
        out[f"{dt}_s"] = _timeit(lambda f=f, t=t: f(t, x), args.repeats)
    return out


@cli
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("step")
    s.add_argument("--config", default="tiny")
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--out", default="/tmp/dflash_bench_step")
    s.add_argument("--peak-tflops", type=float, default=None, help="per-device peak, to report MFU")
    s.add_argument("overrides", nargs="*")
    a = sub.add_parser("attention")
    for name, default in (
        ("rows", 2),
        ("length", 2048),
        ("anchors", 64),
        ("block", 16),
        ("heads", 8),
        ("kv_heads", 2),
        ("head_dim", 64),
        ("repeats", 3),
    ):
        a.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    a.add_argument("--docs", type=int, default=4, help="equal documents packed per row")
    a.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a.add_argument("--impls", nargs="+", default=["reference", "xla", "pallas"])
    g = sub.add_parser("generate")
    g.add_argument("--target", default="smollm2")
    g.add_argument("--dtype", default="float32")
    for name, default in (("batch", 32), ("prompt", 128), ("new", 128)):
        g.add_argument(f"--{name}", type=int, default=default)
    lo = sub.add_parser("loss")
    for name, default in (("slots", 1920), ("hidden", 576), ("vocab", 49152), ("chunk", 512), ("repeats", 2)):
        lo.add_argument(f"--{name}", type=int, default=default)
    tg = sub.add_parser("target")
    tg.add_argument("--target", default="smollm2")
    for name, default in (("rows", 4), ("length", 384), ("repeats", 2)):
        tg.add_argument(f"--{name}", type=int, default=default)
    from dflash_jax.tools import bench_compare

    bench_compare.add_parser(sub)
    args = p.parse_args(argv)
    if args.what == "compare":
        args.bench_attention = bench_attention
        print(json.dumps(bench_compare.run_compare(args), indent=2, default=str))
        return 0
    result = {
        "step": bench_step,
        "attention": bench_attention,
        "generate": bench_generate,
        "loss": bench_loss,
        "target": bench_target,
    }[args.what](args)
    print(json.dumps(result, indent=2))
    return 0
