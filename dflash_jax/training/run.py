"""The training run wired together: ``run(cfg)`` is what ``python -m dflash_jax.train`` executes.

Order matters and is the point of this module: data sources and the output dir are checked before
any model loads; the pre-flight memory plan runs before the target loads; the drafter is placed on
the mesh before its optimizer is made; the held-out measurements bracket the loop. Each step of
the wiring is owned elsewhere in ``dflash_jax.training``: ``setup`` (target, tokenizer, drafter
config, warm start), ``regen_cache`` (the target's own replies), ``feature_cache`` (offline
features), ``step`` (the jitted step), ``loop`` (steps, stop flags, checkpoints), ``evaluation``
(held-out metrics and tau), ``run_dir`` and ``metrics``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import jax
from flax import nnx

from dflash_jax import distributed
from dflash_jax.cli import log_library_logs_to
from dflash_jax.config_io import ConfigError
from dflash_jax.sharding import BATCH_AXES, logical_sharding, make_mesh, shard_module
from dflash_jax.training.run_config import RunConfig

log = logging.getLogger("dflash_jax.train")


def run(
    cfg: RunConfig,
    *,
    resume: bool = False,
    resume_step: int | None = None,
    overwrite: bool = False,
    init_from: str | None = None,
    quiet: bool = False,
    stop_at_step: int | None = None,
    device_memory: int | None = None,
    preflight: Callable | None = None,
) -> dict:
    """Train per ``cfg``; returns a summary dict (plus the live ``drafter`` and ``target``).

    ``preflight(cfg, target_dir, mesh, device_memory, quiet=...)`` runs before the target loads (the
    entry point passes ``dflash_jax.tools.plan.check_run_fits``: the training package imports no tool);
    ``device_memory`` (bytes per device) is handed to it and forces its memory plan.
    ``resume_step`` resumes from that checkpoint instead of the latest (the later ones are moved
    aside, not deleted: ``run_dir.set_aside_checkpoints``). ``stop_at_step`` ends this invocation
    early, exactly like a preemption (checkpoint, exit), so a later ``resume=True`` run continues
    the same schedule. Before any model is built the data
    sources are found, the output dir is checked (one run per dir: ``overwrite`` replaces an old
    run, ``resume`` must not change what shapes the model or the data) and made sure writable.
    """
    from transformers import AutoTokenizer

    import dflash_jax
    from dflash_jax.checkpoint import Checkpointer, read_checkpoint_config
    from dflash_jax.data.pipeline import to_global_batch
    from dflash_jax.data.shards import ShardedBatchIterator, merge_states, resolve_num_shards
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.training import draft_vocab, evaluation, feature_cache, setup
    from dflash_jax.training import run_dir as run_dirs
    from dflash_jax.training.loop import train_loop
    from dflash_jax.training.metrics import MetricLogger, NullLogger, plot_metrics
    from dflash_jax.training.regen_cache import data_configs, regenerated_data
    from dflash_jax.training.step import make_eval_step, make_optimizer, make_train_step

    t_start = time.perf_counter()
    setup.check_data_sources(cfg)
    setup.check_layout(cfg, jax.device_count(), jax.process_count())
    primary = distributed.is_primary()  # the one process that logs and writes outputs
    # One process prepares (or replaces) the output dir; the others wait for it.
    if primary:
        run_dir = run_dirs.prepare(cfg.output_dir, resume=resume, overwrite=overwrite)
    distributed.barrier("prepare_run_dir")
    if not primary:
        run_dir = Path(cfg.output_dir).resolve()
    else:  # orbax's own log: kept with the run, out of the terminal (dflash_jax.cli)
        log_library_logs_to(run_dir / "orbax.log")
    resume = resume or resume_step is not None
    if resume:
        stored, _ = read_checkpoint_config(run_dir, resume_step)
        changed = run_dirs.check_resume_config(stored, cfg.to_dict())
        if changed:
            log.info("resuming with changed settings: %s", ", ".join(changed))
    mesh = make_mesh(cfg.mesh)
    if jax.process_count() > 1:
        if cfg.regen.enabled or cfg.eval.num_prompts:
            raise ConfigError(
                "regen.enabled and eval.num_prompts > 0 run on one process only: set regen.enabled=false "
                "eval.num_prompts=0 for a multi-process run (measure tau with python -m dflash_jax.eval)"
            )
        if primary:  # prepare shared files (the tiny target, assets) once, before the others read them
            setup.resolve_target(cfg, run_dir)
        distributed.barrier("resolve_target")
    target_dir, tok_dir = setup.resolve_target(cfg, run_dir)
    if preflight is not None:
        preflight(cfg, target_dir, mesh, device_memory, quiet=quiet)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    target = dflash_jax.load_target(target_dir, dtype=cfg.target.dtype, mesh=mesh)
    tc = target.config
    log.info(
        "target %s: %d layers, hidden %d, vocab %d", target_dir, tc.num_layers, tc.hidden_size, tc.vocab_size
    )

    data_cfg, heldout_cfg = cfg.data, None
    eval_prompts = evaluation.heldout_prompt_ids(cfg, tokenizer)
    if cfg.regen.enabled:
        data_cfg, heldout_cfg = data_configs(cfg, *regenerated_data(cfg, target, tokenizer, target_dir))

    warm_path = init_from or cfg.drafter.init_from
    source = setup.load_warm_start(warm_path, target) if warm_path else None
    dcfg = setup.build_drafter_config(
        cfg, target, tokenizer, source=None if source is None else source.config, source_path=warm_path
    )
    features_dir = cfg.data.features
    if features_dir == "auto":  # built once beside the regenerated data, reused by later runs
        features_dir = feature_cache.auto_cache_dir(
            cfg, data_cfg, target_dir, tokenizer, dcfg.target_layer_ids
        )
        if not (features_dir / feature_cache.MANIFEST).is_file():
            if jax.process_count() > 1:
                raise ConfigError(
                    "data.features=auto builds its cache on one process: build it with python -m "
                    "dflash_jax.features and pass its directory"
                )
            log.info("building the feature cache %s (once; later runs reuse it)", features_dir)
            with jax.set_mesh(mesh):
                feature_cache.write_cache(
                    cfg,
                    data_cfg,
                    target,
                    tokenizer,
                    target_dir,
                    dcfg.target_layer_ids,
                    features_dir,
                    mesh=mesh,
                    quiet=quiet,
                )
    drafter = init_drafter(dcfg, target, cfg.train.seed)
    has_vocab = False
    if source is None and cfg.drafter.init == "target" and not resume:
        setup.init_from_target_layers(drafter, target)
    if source is not None:
        setup.init_params_from(drafter, source, warm_path)
        has_vocab = source.config.draft_vocab_size is not None
        del source
    if dcfg.draft_vocab_size is not None and not resume and not has_vocab:
        vocab_summary = draft_vocab.choose_for_run(
            cfg,
            drafter,
            target,
            tokenizer,
            data_cfg,
            mesh,
            features_dir=features_dir,
            quiet=quiet or not primary,
        )
        if primary:
            (run_dir / "draft_vocab.json").write_text(json.dumps(vocab_summary, indent=2))
    shard_module(drafter, mesh)
    optimizer = nnx.Optimizer(drafter, make_optimizer(cfg.train), wrt=nnx.Param)
    # Its scalar counters too: left unplaced, step 2 sees new input shardings and recompiles.
    shard_module(optimizer, mesh)
    train_step, eval_step = make_train_step(cfg.train), make_eval_step(cfg.train)

    resolved = cfg.to_dict()
    resolved["drafter_config"] = dcfg.to_dict()
    resolved["target_dir"] = str(target_dir)
    if primary:
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
    if resume_step is not None:  # before orbax lists the steps: later ones would shadow this one
        if primary:
            run_dirs.set_aside_checkpoints(run_dir, resume_step)
        distributed.barrier("set_aside_checkpoints")
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    start_step, data_state = 0, None
    if resume:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt.directory}")
        meta = ckpt.restore(drafter, optimizer, step=resume_step, mesh=mesh)
        start_step, data_state = int(meta["step"]), meta.get("data_state")
        log.info("resumed from step %d", start_step)
    if features_dir:  # stored target outputs instead of the target (training/feature_cache.py)
        data_iter = feature_cache.open_for_run(
            cfg,
            data_cfg,
            target_dir,
            tokenizer,
            dcfg.target_layer_ids,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            path=features_dir,
        )
    else:  # this process's logical data shards (data/shards.py): batches independent of the process count
        data_iter = ShardedBatchIterator(
            data_cfg,
            tokenizer,
            num_shards=resolve_num_shards(cfg.data.shards, jax.process_count(), data_state),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
    if data_state is not None:
        data_iter.set_state(data_state)

    # The learning-rate schedule's length, once estimated from the time budget, stays fixed
    # across resumes (see training/loop.py).
    schedule_file = run_dir / "lr_schedule.json"
    decay_steps = None
    if resume and schedule_file.is_file():
        decay_steps = int(json.loads(schedule_file.read_text())["decay_steps"])
    elif not resume:
        schedule_file.unlink(missing_ok=True)

    batch_sharding = logical_sharding(mesh, BATCH_AXES)

    def put(batch):  # this process's rows -> global arrays, rows over the data axes
        return to_global_batch(batch, batch_sharding)

    def save(step, force, data_state):
        # collective: every process's shard positions go into the checkpoint
        data_state = merge_states(distributed.allgather_json(data_state))
        ckpt.save(step, drafter, optimizer, data_state, resolved, force=force)

    held_batches = [put(b) for b in evaluation.heldout_batches(tokenizer, heldout_cfg)]
    logger = MetricLogger(run_dir, resume_step=start_step if resume else None) if primary else NullLogger()
    eval_key = jax.random.key(cfg.train.seed + 1)
    result = {"run_dir": str(run_dir), "start_step": start_step}

    def heldout_tau(when: str):
        if not eval_prompts:
            return
        rep = evaluation.measure_tau(cfg, target, drafter, tokenizer, eval_prompts)
        result[f"tau_{when}"], result[f"eval_{when}"] = rep["tau"], rep
        (run_dir / f"eval_{when}.json").write_text(json.dumps(rep, indent=2))
        slots = " ".join("-" if a is None else f"{a:.2f}" for a in rep["per_slot_acceptance"][:8])
        log.info(
            "held-out tau %s training: %.3f +- %.3f (s.e.) over %d prompts x %d tokens (%d verify steps); "
            "acceptance of draft slots 1..8: %s",
            when,
            rep["tau"],
            rep["tau_stderr"] or 0.0,
            rep["num_prompts"],
            cfg.eval.max_new_tokens,
            rep["verify_steps"],
            slots,
        )

    def tau_curve(step: int):  # a short held-out tau during training, for the curve in metrics.png
        rep = evaluation.measure_tau(
            cfg,
            target,
            drafter,
            tokenizer,
            eval_prompts[: cfg.eval.curve_prompts],
            max_new_tokens=cfg.eval.curve_max_new_tokens,
        )
        logger.log(step, {"tau": rep["tau"]}, prefix="heldout")
        log.info(
            "step %d: held-out tau %.3f (%d prompts x %d tokens)",
            step,
            rep["tau"],
            rep["num_prompts"],
            cfg.eval.curve_max_new_tokens,
        )

    def heldout_streak(step: int, when: str):
        metrics = evaluation.heldout_metrics(eval_step, drafter, target, held_batches, eval_key)
        if metrics is not None:
            logger.log(step, metrics, prefix="heldout")
            result[f"heldout_streak_{when}"] = float(metrics["streak"])
            log.info("held-out streak %s training: %.3f", when, metrics["streak"])

    with jax.set_mesh(mesh):
        if start_step == 0 and cfg.eval.before_training:
            heldout_tau("before")
        if start_step == 0:
            heldout_streak(0, "before")
        try:
            done = train_loop(
                cfg.train,
                train_step=train_step,
                drafter=drafter,
                optimizer=optimizer,
                target=target,
                data_iter=data_iter,
                put=put,
                save=save,
                logger=logger,
                start_step=start_step,
                resumed=resume,
                stop_at_step=stop_at_step,
                quiet=quiet or not primary,
                max_wait_s=data_cfg.max_wait_s,
                check_saves=ckpt.check,
                decay_steps=decay_steps,
                on_decay_steps=lambda n: schedule_file.write_text(json.dumps({"decay_steps": n})),
                on_eval=tau_curve if eval_prompts and primary and jax.process_count() == 1 else None,
                eval_every_s=None
                if cfg.eval.curve_every_minutes is None
                else 60 * cfg.eval.curve_every_minutes,
            )
        except BaseException:
            with contextlib.suppress(Exception):  # the error that stopped the run is the one to report
                ckpt.close()
            with contextlib.suppress(Exception):
                logger.close()
            data_iter.close()
            raise
        ckpt.close()
        data_iter.close()
        result.update(step=done.step, interrupted=done.interrupted, train_seconds=done.train_seconds)
        result.update(signal=done.signum, skipped_steps=done.skipped_steps, lr_decay_steps=done.decay_steps)
        if done.last:
            result.update(loss=float(done.last["loss"]), streak=float(done.last["streak"]))
        heldout_streak(done.step, "after")
        heldout_tau("after")
    logger.close()
    if primary:
        result["plot"] = str(plot_metrics(logger.jsonl_path, run_dir / "metrics.png"))
    result["checkpoint_dir"] = str(ckpt.directory)
    result["total_seconds"] = time.perf_counter() - t_start
    result["drafter"] = drafter
    result["target"] = target
    return result
