"""Side-by-side benchmarks against the PyTorch references: ``python -m dflash_jax.bench compare WHAT``.

``target``: target forward (feature taps on) vs transformers; ``drafter-step``: the
training step (the trainer's jitted step: loss, AdamW, update checks) with target features and
labels given, vs the same step on z-lab's ``DFlashDraftModel`` with a dense anchored mask; ``eval``: speculative decoding per generated
token vs z-lab's ``dflash_generate`` on the transformers target, and plain greedy of each;
``attention``: the anchored attention per implementation (``bench attention``'s code);
``matmuls``: each distinct matmul shape of those models alone, jitted einsum vs torch ``linear``.

Every comparison warms both sides up first (our first call, compile included, is reported
apart), then interleaves ours / reference repetitions so machine load hits both alike, and
reports medians and the ratio reference / ours (> 1: ours faster). The matmul peak (fp32,
jitted) is measured in the same run, so achieved FLOP/s reads against this machine's own roof.
Default shapes are the demo's (SmolLM2-135M, 2-layer B=16 drafter); ``--small`` uses a tiny
random Qwen3 target for a quick run (and the tests).
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _median_pair(ours, ref, repeats: int) -> dict:
    """Interleaved repetitions of two zero-argument callables (each blocks until done)."""
    t0 = time.perf_counter()
    ours()
    first = time.perf_counter() - t0
    ref()  # reference warm-up (allocator, oneDNN primitive caches)
    a, b = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        ours()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref()
        b.append(time.perf_counter() - t)
    mo, mr = statistics.median(a), statistics.median(b)
    return {
        "ours_s": mo,
        "ref_s": mr,
        "ours_first_call_s": first,
        "compile_s_approx": max(first - mo, 0.0),
        "ours_spread_s": [min(a), max(a)],
        "ref_spread_s": [min(b), max(b)],
        "ratio_ref_over_ours": mr / mo,
    }


def _maybe_profile(args, ours, jitted=None, *call_args) -> dict | None:
    """``--profile``: a ``jax.profiler`` summary of one more call of ours (see dflash_jax.tools.profiling)."""
    if not getattr(args, "profile", False):
        return None
    from dflash_jax.tools.profiling import profile

    texts = []
    if jitted is not None:
        try:
            texts.append(jitted.lower(*call_args).compile().as_text())
        except Exception:  # noqa: BLE001 - op descriptions are a nicety; the timings stand without them
            pass
    return profile(ours, hlo_texts=texts)


def matmul_peak(n: int = 1024, repeats: int = 5) -> dict:
    """Measured fp32 GFLOP/s of a jitted [n,n]x[n,n] matmul and of torch's, best of ``repeats``."""
    import torch

    x = jax.random.normal(jax.random.key(0), (n, n))
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    tx = torch.randn(n, n)
    torch.mm(tx, tx)
    best_j = best_t = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best_j = min(best_j, time.perf_counter() - t)
        t = time.perf_counter()
        torch.mm(tx, tx)
        best_t = min(best_t, time.perf_counter() - t)
    flops = 2 * n**3
    return {"n": n, "jax_gflops": flops / best_j / 1e9, "torch_gflops": flops / best_t / 1e9}


# ------------------------------------------------------------------------------------------
# Models: the demo target (SmolLM2) or a tiny random Qwen3, loaded by both frameworks
# ------------------------------------------------------------------------------------------


def target_dir(small: bool) -> Path:
    if not small:
        from convert.smollm2 import smollm2_dir

        return smollm2_dir()
    from convert.tiny_target import make_tiny_target_dir
    from dflash_jax.training.run_config import load_run_config

    section = load_run_config("tiny", []).target
    return make_tiny_target_dir(section, 512, Path(tempfile.gettempdir()) / "dflash_bench_tiny_target")


def load_both(path: Path):
    import torch
    import transformers

    import dflash_jax

    target = dflash_jax.load_target(path, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return target, hf


def projection_shapes(cfg, tokens: int, vocab_rows: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of each distinct matmul of the target forward and of the drafter loss."""
    D, H = cfg.hidden_size, cfg.head_dim
    return {
        "q, o": (tokens, D, cfg.num_heads * H),
        "k, v": (tokens, D, cfg.num_kv_heads * H),
        "gate, up": (tokens, D, cfg.intermediate_size),
        "down": (tokens, cfg.intermediate_size, D),
        "lm_head (loss chunk)": (vocab_rows, D, cfg.vocab_size),
        "lm_head pullback": (vocab_rows, cfg.vocab_size, D),
    }


def taps_for(cfg) -> tuple[int, ...]:
    return (1, cfg.num_layers - 3) if cfg.num_layers > 4 else (0, cfg.num_layers - 1)


# ------------------------------------------------------------------------------------------
# target
# ------------------------------------------------------------------------------------------


def compare_target(args) -> dict:
    import torch
    from flax import nnx

    from dflash_jax.tools.flops import target_forward_flops

    path = target_dir(args.small)
    target, hf = load_both(path)
    cfg = target.config
    R, T = (2, 64) if args.small else (args.rows, args.length)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, min(cfg.vocab_size, 30000), size=(R, T)).astype(np.int32)
    taps = taps_for(cfg)
    fwd = nnx.jit(lambda m, x: m(x, layer_ids=taps, return_logits=False).features)
    x = jnp.asarray(ids)
    tx = torch.from_numpy(ids).long()

    def ours():
        fwd(target, x).block_until_ready()

    def ref():
        with torch.no_grad():  # taps = all hidden states; logits only for the last position
            hf(tx, output_hidden_states=True, logits_to_keep=1)

    out = {"target": str(path), "rows": R, "length": T, "taps": list(taps), "dtype": "float32"}
    out.update(_median_pair(ours, ref, args.repeats))
    flops = target_forward_flops(cfg, R * T)
    out["ours_gflops"] = flops / out["ours_s"] / 1e9
    out["ref_gflops"] = flops / out["ref_s"] / 1e9
    out["ours_tokens_per_s"] = R * T / out["ours_s"]
    out["ref_tokens_per_s"] = R * T / out["ref_s"]
    out["profile"] = _maybe_profile(args, ours, fwd, target, x)
    return out


# ------------------------------------------------------------------------------------------
# drafter-step
# ------------------------------------------------------------------------------------------


def _dense_anchored_mask(seg, anchors, valid, S):
    """[R, A*S, T+A*S] bool: block j sees its own document's context before its anchor and its
    own block (bidirectional), as in invariant 3."""
    R, T = seg.shape
    A = anchors.shape[1]
    ctx = np.arange(T)[None, None, :]
    seg_a = np.take_along_axis(seg, anchors, 1)
    see_ctx = (seg[:, None, :] == seg_a[:, :, None]) & (ctx < anchors[:, :, None]) & valid[:, :, None]
    blk = np.zeros((R, A, A * S), bool)
    for j in range(A):
        blk[:, j, j * S : (j + 1) * S] = True
    m = np.concatenate([see_ctx, blk], axis=2)  # [R, A, T+A*S]
    return np.repeat(m, S, axis=1)


# The drafter step's loss chunk limit (slots per vocabulary matmul), ours as in a training run.
STEP_LOSS_CHUNK = 512


def step_shape(args) -> tuple[int, int, int, int, int]:
    """(block size S, drafter layers L, rows R, length T, anchors A) of the drafter step."""
    S, L = (4, 1) if args.small else (16, 2)
    R, T, A = (2, 64, 8) if args.small else (args.rows, args.length, args.anchors)
    return S, L, R, T, A


def compare_drafter_step(args) -> dict:
    """The training step (``training.step.make_train_step``: the trainer's jitted step, its
    optimizer, loss and update checks) on a batch from the feature cache's layout (target features
    and per-position labels given: no target forward), vs the same step on z-lab's model."""
    import torch
    import torch.nn.functional as F
    from dflash import model as dm
    from flax import nnx

    from convert.zlab_drafter import write_zlab_drafter
    from dflash_jax.drafter.api import get_params, init_drafter
    from dflash_jax.drafter.config import DrafterConfig
    from dflash_jax.tools.flops import drafter_train_flops
    from dflash_jax.training.anchors import sample_anchors, slot_targets
    from dflash_jax.training.loss import slot_weights
    from dflash_jax.training.run_config import TrainSection
    from dflash_jax.training.step import gather_positions, make_optimizer, make_train_step

    path = target_dir(args.small)
    target, hf = load_both(path)
    cfg = target.config
    S, L, R, T, A = step_shape(args)
    taps = taps_for(cfg)
    dcfg = DrafterConfig.for_target(
        cfg,
        num_layers=L,
        mask_token_id=cfg.vocab_size - 1,
        block_size=S,
        target_layer_ids=taps,
        attention_impl="xla",
    )
    train = TrainSection(max_anchors=A, loss="ce", loss_chunk=STEP_LOSS_CHUNK, learning_rate=1e-3)
    drafter = init_drafter(dcfg, target, 0)
    with tempfile.TemporaryDirectory() as d:
        write_zlab_drafter(d, dcfg, jax.device_get(get_params(drafter)), dtype="float32")
        zmodel = dm.DFlashDraftModel.from_pretrained(d, dtype=torch.float32).train()

    # One batch, one document per row, with the feature cache's arrays: the target's tapped
    # features and its argmax per position (the ce labels).
    rng = np.random.default_rng(0)
    ids = rng.integers(0, min(cfg.vocab_size - 1, 30000), size=(R, T)).astype(np.int32)
    seg = np.ones((R, T), np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (R, T)).copy()
    out_t = target(
        jnp.asarray(ids), jnp.asarray(pos), segment_ids=jnp.asarray(seg), layer_ids=taps, return_logits=False
    )
    lm_head = target.lm_head_weight()  # [D, V]
    position_labels = jnp.argmax(out_t.hidden @ lm_head, -1).astype(jnp.int32)  # [R, T]
    batch = {
        "input_ids": jnp.asarray(ids),
        "positions": jnp.asarray(pos),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.ones((R, T), jnp.int32),
        "features": out_t.features,
        "labels": position_labels,
    }
    key = jax.random.key(0)
    # The anchors the step draws from this key (drafter_loss: the first half of its split) and
    # the slots it trains, so the reference trains the same blocks with the same weights.
    anchors, valid = sample_anchors(
        jax.random.split(key)[0], batch["loss_mask"], batch["segment_ids"], max_anchors=A
    )
    label_pos, trained = slot_targets(anchors, valid, batch["loss_mask"], batch["segment_ids"], S)
    labels = gather_positions(position_labels, label_pos)  # [R, A, S-1]
    embeds = drafter.train_block_embeds(target, batch["input_ids"], anchors)  # [R, A, S, D]
    w = np.asarray(slot_weights(S, train.gamma, train.loss_weighting))[1:]
    weights = (w * np.asarray(trained)).reshape(-1).astype(np.float32)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    D = cfg.hidden_size

    optimizer = nnx.Optimizer(drafter, make_optimizer(train), wrt=nnx.Param)
    step = make_train_step(train)
    lr = np.float32(train.learning_rate)

    # reference: z-lab's model on [context ; all blocks] with the dense mask, same loss and AdamW
    t_feats = torch.from_numpy(np.array(out_t.features))
    t_noise = torch.from_numpy(np.array(embeds).reshape(R, A * S, D))
    slot_pos = anchors[:, :, None] + np.arange(S)[None, None]
    t_pos = torch.from_numpy(np.concatenate([pos, slot_pos.reshape(R, -1)], 1)).long()
    t_mask = torch.from_numpy(_dense_anchored_mask(seg, anchors, valid, S))[:, None]
    t_head = torch.from_numpy(np.asarray(lm_head).T.copy())  # [V, D] frozen
    t_labels = torch.from_numpy(np.asarray(labels).reshape(-1)).long()
    t_w = torch.from_numpy(weights)
    topt = torch.optim.AdamW(
        zmodel.parameters(),
        lr=train.learning_rate,
        betas=(train.b1, train.b2),
        weight_decay=train.weight_decay,
    )

    def ref_step():
        topt.zero_grad(set_to_none=True)
        h = zmodel(target_hidden=t_feats, noise_embedding=t_noise, position_ids=t_pos, attention_mask=t_mask)
        h = h.reshape(R, A, S, D)[:, :, 1:].reshape(-1, D)
        loss_i = F.cross_entropy(h @ t_head.T, t_labels, reduction="none")
        loss = (loss_i * t_w).sum() / t_w.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(zmodel.parameters(), train.grad_clip)
        topt.step()
        return loss

    # Same weights, batch, blocks and loss: the first losses agree (before either update).
    l_ours = float(step(drafter, optimizer, target, batch, key, lr)["loss"])
    l_ref = float(ref_step().detach())

    def ours():
        jax.block_until_ready(step(drafter, optimizer, target, batch, key, lr))

    out = {
        "target": str(path),
        "rows": R,
        "length": T,
        "anchors": A,
        "block": S,
        "layers": L,
        "first_loss_ours": l_ours,
        "first_loss_ref": l_ref,
    }
    out.update(_median_pair(ours, ref_step, args.repeats))
    flops = drafter_train_flops(cfg, dcfg, context_tokens=R * T, blocks=int(valid.sum()))
    out["ours_gflops"] = flops / out["ours_s"] / 1e9
    out["ref_gflops"] = flops / out["ref_s"] / 1e9
    profile_args = (drafter, optimizer, target, batch, key, lr)
    out["profile"] = _maybe_profile(args, ours, step, *profile_args)
    return out


# ------------------------------------------------------------------------------------------
# eval
# ------------------------------------------------------------------------------------------


def compare_eval(args) -> dict:
    import torch
    from dflash import model as dm

    from convert.zlab_drafter import write_zlab_drafter
    from dflash_jax.decoding.generate import generate
    from dflash_jax.decoding.speculative import speculative_generate
    from dflash_jax.drafter.api import get_params, init_drafter
    from dflash_jax.drafter.config import DrafterConfig

    path = target_dir(args.small)
    target, hf = load_both(path)
    cfg = target.config
    S, L = (4, 1) if args.small else (16, 2)
    n_prompts, new = (2, 8) if args.small else (args.prompts, args.new)
    dcfg = DrafterConfig.for_target(
        cfg, num_layers=L, mask_token_id=cfg.vocab_size - 1, block_size=S, target_layer_ids=taps_for(cfg)
    )
    drafter = init_drafter(dcfg, target, 0)
    with tempfile.TemporaryDirectory() as d:
        write_zlab_drafter(d, dcfg, jax.device_get(get_params(drafter)), dtype="float32")
        zmodel = dm.DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    dm._cuda_time = time.perf_counter  # dflash_generate's stats clock is CUDA-only
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, min(cfg.vocab_size - 1, 30000), size=n).tolist()
        for n in np.linspace(24, 56, n_prompts).astype(int)
    ]

    res = {}

    def ours_spec():
        res["ours"] = speculative_generate(target, drafter, prompts, max_new_tokens=new, batch_size=1)

    def ref_spec():
        res["ref"] = [
            dm.dflash_generate(zmodel, hf, torch.tensor(p)[None], new, None, return_stats=True)
            for p in prompts
        ]

    def ours_greedy():
        generate(target, prompts, max_new_tokens=new, batch_size=1)

    def ref_greedy():
        with torch.no_grad():
            for p in prompts:
                hf.generate(torch.tensor(p)[None], max_new_tokens=new, min_new_tokens=new, do_sample=False)

    tokens = n_prompts * new
    spec = _median_pair(ours_spec, ref_spec, args.repeats)
    greedy = _median_pair(ours_greedy, ref_greedy, args.repeats)
    same = all(
        o.output_ids == r.output_ids[0, len(p) :].tolist()
        for o, r, p in zip(res["ours"], res["ref"], prompts, strict=True)
    )
    out = {
        "target": str(path),
        "prompts": n_prompts,
        "new_tokens": new,
        "block": S,
        "layers": L,
        "batch": 1,
        "same_tokens_as_zlab": same,
        "tau_ours": float(np.mean([np.mean(o.acceptance_lengths) for o in res["ours"]])),
    }
    out["profile"] = _maybe_profile(args, ours_spec)
    for name, r in (("spec", spec), ("greedy", greedy)):
        out[name] = {
            **r,
            "ours_ms_per_token": 1e3 * r["ours_s"] / tokens,
            "ref_ms_per_token": 1e3 * r["ref_s"] / tokens,
        }
    return out


# ------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------


def compare_attention(args) -> dict:
    """``bench attention`` (one implementation each), with each ratio against ``reference``.
    ``args.bench_attention`` is that function, handed over by ``dflash_jax.tools.bench`` (the CLI that
    imports this module), so the two modules do not import each other."""
    import argparse

    bench_attention = args.bench_attention
    shape = (
        dict(rows=2, length=128, anchors=8, block=4, heads=4, kv_heads=2, head_dim=16)
        if args.small
        else dict(rows=2, length=1024, anchors=64, block=16, heads=9, kv_heads=3, head_dim=64)
    )
    ns = argparse.Namespace(**shape, repeats=args.repeats, impls=args.impls, docs=4, dtype="float32")
    out = bench_attention(ns)
    ref = out.get("reference", {}).get("fwd_bwd_ms")
    for impl in args.impls:
        r = out.get(impl, {})
        if ref and "fwd_bwd_ms" in r:
            r["ratio_reference_over_impl"] = ref / r["fwd_bwd_ms"]
    return out


def compare_matmuls(args) -> dict:
    """Each distinct matmul shape of the target forward and the drafter loss, alone: ours as the
    models write it (``jnp.einsum`` under jit, weights [in, out]) vs ``torch.nn.functional.linear``
    (weights [out, in]), same fp32 inputs; ours also with the weights stored [out, in]. Says
    whether a model-level gap is the matmuls' or what surrounds them, and whether the weight
    layout matters."""
    from dflash_jax.target.config import TargetConfig
    from dflash_jax.training.loss import even_chunks

    cfg = TargetConfig.from_pretrained(target_dir(args.small))
    tokens = 128 if args.small else args.rows * args.length
    S, _, R, _, A = step_shape(args)
    _, rows = even_chunks(R * A * (S - 1), STEP_LOSS_CHUNK)  # one loss chunk of the drafter step
    rng = np.random.default_rng(0)
    out = {"tokens": tokens, "shapes": {}}
    for name, (M, K, N) in projection_shapes(cfg, tokens, rows).items():
        x = rng.standard_normal((M, K), dtype=np.float32)
        w = rng.standard_normal((K, N), dtype=np.float32)
        r = _linear_pair(x, w, args.repeats)
        # The same product with our weights stored [out, in] as torch's: is the layout the gap?
        r_t = _linear_pair(x, w, args.repeats, weights_out_in=True)
        r["shape"] = [M, K, N]
        r["ours_gflops"] = 2 * M * K * N / r["ours_s"] / 1e9
        r["ref_gflops"] = 2 * M * K * N / r["ref_s"] / 1e9
        r["ours_out_in_s"] = r_t["ours_s"]
        r["ratio_ref_over_ours_out_in"] = r_t["ratio_ref_over_ours"]
        out["shapes"][name] = r
    return out


def _linear_pair(x: np.ndarray, w: np.ndarray, repeats: int, *, weights_out_in: bool = False) -> dict:
    """``_median_pair`` of x @ w [K, N] as a jitted einsum (weights stored [K, N], or [N, K] with
    ``weights_out_in``) and as torch's ``linear``."""
    import torch

    spec, weight = ("MK,NK->MN", w.T) if weights_out_in else ("MK,KN->MN", w)
    mm = jax.jit(lambda a, b: jnp.einsum(spec, a, b))
    jx, jw = jnp.asarray(x), jnp.asarray(np.ascontiguousarray(weight))
    tx, tw = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w.T))
    return _median_pair(
        lambda: mm(jx, jw).block_until_ready(), lambda: torch.nn.functional.linear(tx, tw), repeats
    )


COMPARES = {
    "target": compare_target,
    "matmuls": compare_matmuls,
    "drafter-step": compare_drafter_step,
    "eval": compare_eval,
    "attention": compare_attention,
}


# The shapes of the comparisons (the markdown's command line repeats those that differ).
SHAPE_DEFAULTS = {"rows": 2, "length": 384, "anchors": 64, "prompts": 3, "new": 32,
                  "impls": ["reference", "xla", "pallas"]}  # fmt: skip


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="ours vs the PyTorch reference, side by side")
    c.add_argument("which", choices=[*COMPARES, "all"])
    c.add_argument("--small", action="store_true", help="tiny random target: a quick run")
    c.add_argument("--repeats", type=int, default=3)
    for name, default in SHAPE_DEFAULTS.items():
        if isinstance(default, list):
            c.add_argument(f"--{name}", nargs="+", default=list(default))
        else:
            c.add_argument(f"--{name}", type=int, default=default)
    c.add_argument("--markdown", default=None, help="also write the tables to this file")
    c.add_argument("--overwrite", action="store_true", help="replace an existing --markdown file")
    c.add_argument(
        "--profile", action="store_true", help="add a jax.profiler summary of one call of ours to each table"
    )


def cpu_description() -> str:
    """CPU model and its widest vector ISA (the dev/CI boxes differ between days: AVX2 or AVX-512)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags] or [
        f for f in ("avx2",) if f in flags
    ]
    return f"{model or 'unknown CPU'} ({', '.join(isa) or 'no AVX2'})"


def run_compare(args) -> dict:
    which = list(COMPARES) if args.which == "all" else [args.which]
    if args.markdown:  # before the first comparison (minutes): a file from an earlier run stays
        from dflash_jax.cli import check_output_free

        check_output_free(args.markdown, overwrite=getattr(args, "overwrite", False), flag="--markdown")
    out = {
        "machine": {
            "cpu": cpu_description(),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "backend": jax.default_backend(),
            "jax": jax.__version__,
        },
        "matmul_peak": matmul_peak(),
    }
    for w in which:
        t = time.perf_counter()
        out[w] = COMPARES[w](args)
        out[w]["wall_s"] = time.perf_counter() - t
        out["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
        if args.markdown:  # after every comparison: a long `all` run that dies keeps what it measured
            Path(args.markdown).write_text(markdown(out, args))
    return out


def command_line(args) -> str:
    """The compare command that reproduces a run: every option whose value is not its default."""
    parts = ["python -m dflash_jax.bench compare", args.which]
    parts += [f"--{flag}" for flag in ("small", "profile") if getattr(args, flag, False)]
    parts.append(f"--repeats {args.repeats}")
    for name, default in SHAPE_DEFAULTS.items():
        value = getattr(args, name, default)
        if value != default:
            parts.append(f"--{name} " + (" ".join(value) if isinstance(value, list) else str(value)))
    return " ".join(parts)


def markdown(out: dict, args) -> str:
    m, peak = out["machine"], out["matmul_peak"]
    lines = [
        f"Command: `{command_line(args)}`; {m.get('cpu', 'CPU')}, {m['cpus']} CPUs, load average {m['load_avg_1m']:.1f} "
        f"at start / {m['load_avg_1m_end']:.1f} at end; jax {m['jax']} ({m['backend']}); fp32 matmul peak "
        f"measured in the run: jax {peak['jax_gflops']:.0f} GFLOP/s, torch {peak['torch_gflops']:.0f} GFLOP/s. "
        "Medians of interleaved repetitions; ratio = reference time / ours (> 1: ours faster).",
        "",
        "| comparison | shape | ours | reference | ratio | ours GFLOP/s (% of peak) | our first call (compile) |",
        "|---|---|---|---|---|---|---|",
    ]
    pk = peak["jax_gflops"]
    if "target" in out:
        r = out["target"]
        lines.append(
            f"| target fwd vs transformers | {r['rows']}x{r['length']} tok, taps {r['taps']} | "
            f"{r['ours_s'] * 1e3:.0f} ms | {r['ref_s'] * 1e3:.0f} ms | {r['ratio_ref_over_ours']:.2f} | "
            f"{r['ours_gflops']:.0f} ({100 * r['ours_gflops'] / pk:.0f}%) | {r['ours_first_call_s']:.1f} s |"
        )
    if "drafter-step" in out:
        r = out["drafter-step"]
        lines.append(
            f"| drafter step vs z-lab DFlashDraftModel + AdamW | {r['rows']}x{r['length']}, {r['anchors']} anchors, "
            f"B={r['block']}, {r['layers']} layers | {r['ours_s'] * 1e3:.0f} ms | {r['ref_s'] * 1e3:.0f} ms | "
            f"{r['ratio_ref_over_ours']:.2f} | {r['ours_gflops']:.0f} ({100 * r['ours_gflops'] / pk:.0f}%) | "
            f"{r['ours_first_call_s']:.1f} s |"
        )
    if "matmuls" in out:
        for name, r in out["matmuls"]["shapes"].items():
            M, K, N = r["shape"]
            lines.append(
                f"| matmul alone: {name} vs torch linear | [{M},{K}]x[{K},{N}] | {r['ours_s'] * 1e3:.1f} ms "
                f"(weights [out,in]: {r['ours_out_in_s'] * 1e3:.1f} ms, ratio {r['ratio_ref_over_ours_out_in']:.2f}) | "
                f"{r['ref_s'] * 1e3:.1f} ms | {r['ratio_ref_over_ours']:.2f} | {r['ours_gflops']:.0f} "
                f"({100 * r['ours_gflops'] / pk:.0f}%); torch {r['ref_gflops']:.0f} | — |"
            )
    if "eval" in out:
        r = out["eval"]
        for name, label in (
            ("spec", "speculative vs z-lab dflash_generate"),
            ("greedy", "plain greedy vs HF generate"),
        ):
            x = r[name]
            lines.append(
                f"| {label} (per token) | {r['prompts']} prompts x {r['new_tokens']} new, batch 1, tau "
                f"{r['tau_ours']:.2f} | {x['ours_ms_per_token']:.1f} ms | {x['ref_ms_per_token']:.1f} ms | "
                f"{x['ratio_ref_over_ours']:.2f} | — | {x['ours_first_call_s']:.1f} s |"
            )
    if "attention" in out:
        r = out["attention"]
        sh = r["shape"]
        ref = r.get("reference", {}).get("fwd_bwd_ms")
        for impl in args.impls:
            x = r.get(impl, {})
            val = f"{x['fwd_bwd_ms']:.0f} ms" if "fwd_bwd_ms" in x else f"not run: {x.get('error', '?')[:60]}"
            ratio = f"{x['ratio_reference_over_impl']:.2f}" if "ratio_reference_over_impl" in x else "—"
            lines.append(
                f"| attention fwd+bwd: {impl} vs reference | {sh['rows']}x{sh['length']}, {sh['anchors']}x{sh['block']} | "
                f"{val} | {ref:.0f} ms | {ratio} | — | — |"
            )
    from dflash_jax.tools.profiling import markdown_lines

    for key in ("target", "drafter-step", "eval"):
        if out.get(key, {}).get("profile"):
            lines += ["", *markdown_lines(out[key]["profile"], f"ours, {key}")]
    return "\n".join(lines) + "\n"
