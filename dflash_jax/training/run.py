"""The training run wired together: ``run(cfg)`` is what ``python -m dflash_jax.train`` executes.

Order matters and is the point of this module: data sources and the output dir are checked before
any model loads; the pre-flight memory plan (passed in by the entry point: the planner is a tool,
``dflash_jax.tools.plan``) runs before the target loads; the drafter is placed on the mesh before
its optimizer is made; the held-out measurements bracket the loop. Each step of the wiring is
owned elsewhere in ``dflash_jax.training``: ``assembly`` (target, tokenizer, data, drafter config,
warm start, the checks, the drafter's initialisation), ``regen_cache`` (the target's own replies),
``feature_cache`` (offline features), ``draft_vocab``, ``step`` (the jitted step), ``trainer`` (the
loop: step, state, clock), ``hooks`` (signals, metrics, checkpoints, the tau curve, stops),
``schedule`` (learning rate, time budget), ``evaluation`` (held-out metrics and tau), ``run_dir``
and ``metrics``. The loop's wiring (:func:`_trainer`) lists the hooks in the order they act.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
    resume: bool | str = False,
    resume_step: int | None = None,
    overwrite: bool = False,
    init_from: str | None = None,
    quiet: bool = False,
    stop_at_step: int | None = None,
    device_memory: int | None = None,
    preflight: Callable | None = None,
) -> dict:
    """Train per ``cfg``; returns a summary dict (plus the live ``drafter`` and ``target``).

    ``preflight(cfg, parts, mesh, device_memory, quiet=...)`` runs before the target loads, on the
    parts the run resolved (the entry point passes ``dflash_jax.tools.plan.check_run_fits``: the
    training package imports no tool); it refuses a run whose step cannot fit jax's memory pool on
    the devices, or ``device_memory`` (the card's bytes per device) where they report none, and
    names the pool setting that would fit it. ``resume="auto"`` resumes when ``output_dir`` holds a
    checkpoint and starts afresh otherwise (``run_dir.resume_auto``).
    ``resume_step`` resumes from that checkpoint instead of the latest (the later ones are moved
    aside, not deleted: ``run_dir.set_aside_checkpoints``). ``stop_at_step`` ends this invocation
    early, exactly like a preemption (checkpoint, exit), so a later ``resume=True`` run continues
    the same schedule. Before any model is built the data sources are found, the output dir is
    checked (one run per dir: ``overwrite`` replaces an old run, ``resume`` must not change what
    shapes the model or the data) and made sure writable.
    """
    from dflash_jax.training import run_dir as run_dirs
    from dflash_jax.training.assembly import assemble, load_parts
    from dflash_jax.training.evaluation import final_bench_records
    from dflash_jax.training.metrics import check_trackers_installed, plot_metrics

    t_start = time.perf_counter()
    # Checked before the output dir is touched; resolved once: the pre-flight plans these parts.
    parts = assemble(cfg, init_from=init_from)
    check_trackers_installed(cfg.train.report_to)
    final_bench_records(cfg)  # the benchmark wheels the final report reads are installed
    primary = distributed.is_primary()  # the one process that logs and writes outputs
    if resume == "auto":
        resume, overwrite = run_dirs.resume_auto(cfg.output_dir, overwrite=overwrite)
        log.info("--resume auto: %s", "resuming" if resume else "no checkpoint yet, starting afresh")
    resume = bool(resume) or resume_step is not None
    run_dir = _prepare_run_dir(cfg, primary, resume=resume, resume_step=resume_step, overwrite=overwrite)
    mesh = make_mesh(cfg.mesh)
    if jax.process_count() > 1:
        _prepare_shared_files(cfg, parts, primary)
    if preflight is not None:  # before any weight is read
        preflight(cfg, parts, mesh, device_memory, quiet=quiet)
    parts = load_parts(cfg, parts, mesh=mesh)
    state = _place_drafter(cfg, parts, mesh, run_dir, resume=resume, resume_step=resume_step, quiet=quiet)
    parts = dataclasses.replace(parts, warm_source=None)  # its weights are in the drafter now
    result = {"run_dir": str(run_dir), "start_step": state.step}
    with jax.set_mesh(mesh):
        _train_between_measurements(
            cfg, parts, state, mesh, t_start, result, stop_at_step=stop_at_step, quiet=quiet or not primary
        )
    if primary:
        result["plot"] = str(plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png"))
    result.update(
        checkpoint_dir=str(state.checkpointer.directory),
        total_seconds=time.perf_counter() - t_start,
        drafter=state.drafter,
        target=parts.target,
    )
    return result


@dataclasses.dataclass
class _PlacedDrafter:
    """The drafter and optimizer on the mesh, restored on a resume, and what the loop reads from."""

    drafter: nnx.Module
    optimizer: nnx.Optimizer
    step: int  # the step training starts from
    resumed: bool
    checkpointer: object
    resolved_config: dict  # what config.json and every checkpoint record
    run_dir: Path
    features_dir: Path | None
    data_state: dict | None  # the training data iterator's stored state (a resume)


def _place_drafter(cfg: RunConfig, parts, mesh, run_dir: Path, *, resume: bool, resume_step, quiet: bool):
    """Build (or warm-start) the drafter, place it and its optimizer on the mesh, write the resolved
    config and open the checkpoints; -> :class:`_PlacedDrafter`. The features are cached first:
    the drafter's initialisation may read them."""
    from dflash_jax.training import feature_cache
    from dflash_jax.training.assembly import make_drafter
    from dflash_jax.training.step import make_optimizer

    features_dir = feature_cache.ensure_for_run(cfg, parts, mesh, quiet=quiet)
    drafter = make_drafter(
        cfg, parts, mesh, resume=resume, features_dir=features_dir, run_dir=run_dir, quiet=quiet
    )
    shard_module(drafter, mesh)
    optimizer = nnx.Optimizer(drafter, make_optimizer(cfg.train), wrt=nnx.Param)
    # Its scalar counters too: left unplaced, step 2 sees new input shardings and recompiles.
    shard_module(optimizer, mesh)
    resolved = {
        **cfg.to_dict(),
        "drafter_config": parts.drafter_config.to_dict(),
        "target_dir": str(parts.target_dir),
    }
    if distributed.is_primary():
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
    ckpt, start_step, data_state = _open_checkpoints(
        cfg, run_dir, drafter, optimizer, mesh, resume, resume_step
    )
    return _PlacedDrafter(
        drafter, optimizer, start_step, resume, ckpt, resolved, run_dir, features_dir, data_state
    )


def _train_between_measurements(
    cfg: RunConfig, parts, state: _PlacedDrafter, mesh, t_start: float, result: dict, *, stop_at_step, quiet
) -> None:
    """Held-out measurements before, the loop within the run's time budget, the measurements after;
    fills ``result``. The metrics log is closed on every exit (the error that stopped the run is the
    one reported)."""
    from dflash_jax.data.pipeline import to_global_batch
    from dflash_jax.training import evaluation
    from dflash_jax.training.hooks import Checkpoints
    from dflash_jax.training.metrics import MetricLogger, NullLogger
    from dflash_jax.training.schedule import ScheduleFile, within_run_budget
    from dflash_jax.training.step import make_eval_step, make_train_step
    from dflash_jax.training.trainer import TrainState

    put = functools.partial(to_global_batch, sharding=logical_sharding(mesh, BATCH_AXES))
    resume_step = state.step if state.resumed else None
    logger = NullLogger()
    if distributed.is_primary():
        logger = MetricLogger(
            state.run_dir,
            report_to=cfg.train.report_to,
            resume_step=resume_step,
            run_config=state.resolved_config,
        )
    data_iter = _open_training_data(cfg, parts, state.features_dir, state.data_state)
    try:
        heldout_batches = [put(b) for b in evaluation.heldout_batches(parts.tokenizer, parts.heldout)]
        heldout = evaluation.HeldoutReports(
            cfg, parts, state.drafter, make_eval_step(cfg.train), heldout_batches,
            logger=logger, result=result, run_dir=state.run_dir, keep_best=_keep_best(state),
        )  # fmt: skip
        eval_s = _evaluate_before_training(cfg, heldout, state.step)
        final_s = heldout.final_eval_estimate_s(eval_s)
        train = within_run_budget(
            cfg,
            t_start,
            final_s,
            heldout.curve_estimate_s(eval_s),
            state.step,
            len(parts.eval_prompts),
            bench_eval_s=heldout.bench_estimate_s(final_s if state.step == 0 else 0.0),
        )
        trainer, summary = _trainer(
            cfg,
            train,
            parts,
            train_step=make_train_step(cfg.train),
            put=put,
            checkpoints=Checkpoints(state.checkpointer, state.resolved_config),
            logger=logger,
            heldout=heldout,
            schedule_file=ScheduleFile(state.run_dir / "lr_schedule.json", state.resumed),
            stop_at_step=stop_at_step,
            quiet=quiet,
        )
        start = TrainState(state.drafter, state.optimizer, state.step, resumed=state.resumed)
        done = trainer.train(start, data_iter)
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the run is the one to report
            logger.close()
        raise
    finally:
        data_iter.close()
    result.update(summary(done))
    heldout.streak(done.step, "after")
    heldout.tau("after", done.step)
    heldout.bench(done.step)
    if heldout.keep_best is not None and heldout.keep_best.record is not None:
        result["best_checkpoint"] = heldout.keep_best.summary()
    logger.close()


def _keep_best(state: _PlacedDrafter):
    """The best drafter by validation tau, kept in ``<run>/best/`` (``hooks.KeepBest``; a resume
    continues its record); None in a multi-process run, which measures no validation tau."""
    from dflash_jax.checkpoint import BEST_SUBDIR, BestCheckpoint
    from dflash_jax.training.hooks import KeepBest

    if jax.process_count() > 1:
        return None
    return KeepBest(BestCheckpoint(state.run_dir / BEST_SUBDIR), state.drafter, state.resolved_config)


def _prepare_run_dir(cfg: RunConfig, primary: bool, *, resume: bool, resume_step, overwrite: bool) -> Path:
    """One process prepares (or replaces) the output dir, the others wait for it; a resume's stored
    config is checked against this one (what shapes the model or the data must not change)."""
    from dflash_jax.checkpoint import read_checkpoint_config
    from dflash_jax.training import run_dir as run_dirs

    if primary:
        run_dir = run_dirs.prepare(cfg.output_dir, resume=resume, overwrite=overwrite)
    distributed.barrier("prepare_run_dir")
    if not primary:
        run_dir = Path(cfg.output_dir).resolve()
    else:  # orbax's own log: kept with the run, out of the terminal (dflash_jax.cli)
        log_library_logs_to(run_dir / "orbax.log")
    if resume:
        stored, _ = read_checkpoint_config(run_dir, resume_step)
        changed = run_dirs.check_resume_config(stored, cfg.to_dict())
        if changed:
            log.info("resuming with changed settings: %s", ", ".join(changed))
    return run_dir


def _prepare_shared_files(cfg: RunConfig, parts, primary: bool) -> None:
    """A multi-process run: what runs on one process only is refused; the files every process
    reads (the tiny target) are made once, by the primary, before the others read them."""
    if cfg.regen.enabled or cfg.eval.num_prompts or cfg.eval.final_bench:
        raise ConfigError(
            "regen.enabled, eval.num_prompts > 0 and eval.final_bench run on one process only: set "
            "regen.enabled=false eval.num_prompts=0 eval.final_bench=[] for a multi-process run (measure "
            "tau with python -m dflash_jax.eval)"
        )
    from dflash_jax.training.assembly import prepare_target_dir

    if primary:
        prepare_target_dir(cfg, parts)
    distributed.barrier("resolve_target")


def _open_checkpoints(cfg: RunConfig, run_dir: Path, drafter, optimizer, mesh, resume: bool, resume_step):
    """-> (Checkpointer, the step to start from, the data iterator's stored state). A resume
    restores drafter and optimizer in place; ``resume_step`` first sets the later steps aside
    (before orbax lists the steps: later ones would shadow this one)."""
    from dflash_jax.checkpoint import Checkpointer
    from dflash_jax.training import run_dir as run_dirs

    if resume_step is not None:
        if distributed.is_primary():
            run_dirs.set_aside_checkpoints(run_dir, resume_step)
        distributed.barrier("set_aside_checkpoints")
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    if not resume:
        return ckpt, 0, None
    if ckpt.latest_step() is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt.directory}")
    meta = ckpt.restore(drafter, optimizer, step=resume_step, mesh=mesh)
    log.info("resumed from step %d", int(meta["step"]))
    return ckpt, int(meta["step"]), meta.get("data_state")


def _evaluate_before_training(cfg: RunConfig, heldout, start_step: int) -> float:
    """Held-out tau and streak of a fresh run's initial drafter; -> the seconds they took (what
    the time budget sets aside for the measurements after training is estimated from them)."""
    t0 = time.perf_counter()
    if start_step == 0 and cfg.eval.before_training:
        heldout.tau("before", 0)
    if start_step == 0:
        heldout.streak(0, "before")
    return time.perf_counter() - t0


def _trainer(
    cfg: RunConfig,
    train,
    parts,
    *,
    train_step,
    put,
    checkpoints,
    logger,
    heldout,
    schedule_file,
    stop_at_step,
    quiet,
):
    """The Trainer of this run with its hooks (``train``: ``cfg.train`` within the run's time
    budget); -> (trainer, ``summary(loop_result)``: what the loop reports in the run's result)."""
    from dflash_jax.training import hooks
    from dflash_jax.training.schedule import LearningRateSchedule
    from dflash_jax.training.trainer import Trainer

    schedule = LearningRateSchedule(
        train, decay_steps=schedule_file.decay_steps, on_decay_steps=schedule_file.write
    )
    trainer = Trainer(
        train,
        train_step,
        target=parts.target,
        put=put,
        learning_rate=schedule.rate,
        max_wait_s=parts.data.max_wait_s,
    )
    signals, metrics = hooks.StopOnSignal(), hooks.TrainMetrics(train, logger, quiet=quiet)
    trainer.add_hook(signals)
    trainer.add_hook(schedule)
    trainer.add_hook(metrics)
    trainer.add_hook(hooks.StopOnDivergence(train, checkpoints))
    trainer.add_hook(checkpoints, every=train.checkpoint_every)
    trainer.add_hook(checkpoints.raise_failed_save)
    # the curve decodes on one process (a multi-process run measures tau with dflash_jax.eval)
    if heldout.curve_enabled and distributed.is_primary() and jax.process_count() == 1:
        trainer.add_hook(hooks.TauCurve(heldout.tau_curve, cfg.eval.curve_every_minutes))
    elif cfg.eval.curve_every_minutes and not parts.validation_prompts:
        log.warning(
            "eval.curve_every_minutes=%g: no tau curve, the run has no validation prompts (the curve is "
            "measured on the validation set, never on the test set: set data.validation_count or "
            "data.validation_fraction, and eval.validation_prompts)",
            cfg.eval.curve_every_minutes,
        )
    trainer.add_hook(hooks.StopAt(step=stop_at_step, minutes=train.time_limit_minutes))

    def summary(done) -> dict:
        out = dict(step=done.step, interrupted=signals.signum is not None, train_seconds=done.train_seconds)
        out.update(
            signal=signals.signum, skipped_steps=done.skipped_steps, lr_decay_steps=schedule.decay_steps
        )
        if metrics.last:
            out.update(loss=float(metrics.last["loss"]), streak=float(metrics.last["streak"]))
        return out

    return trainer, summary


def _open_training_data(cfg: RunConfig, parts, features_dir, data_state):
    """This process's training batches: from the feature cache (stored target outputs), else its
    logical data shards (data/shards.py: batches independent of the process count)."""
    from dflash_jax.data.shards import ShardedBatchIterator, resolve_num_shards
    from dflash_jax.training import feature_cache

    if features_dir:
        data_iter = feature_cache.open_for_run(
            cfg,
            parts.data,
            parts.target_dir,
            parts.tokenizer,
            parts.drafter_config.target_layer_ids,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            path=features_dir,
        )
    else:
        data_iter = ShardedBatchIterator(
            parts.data,
            parts.tokenizer,
            num_shards=resolve_num_shards(parts.data.shards, jax.process_count(), data_state),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
    if data_state is not None:
        data_iter.set_state(data_state)
    return data_iter
