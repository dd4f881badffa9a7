"""What a training run does around its steps, as :class:`~dflash_jax.training.trainer.Trainer` hooks.

A run (``training/run.py``) adds them in this order, which is the order they act in after a step:

- :class:`StopOnSignal`: SIGTERM/SIGINT ask the trainer to stop (also while it waits for data); a
  second signal aborts.
- ``schedule.LearningRateSchedule``: the schedule's length from the measured step time.
- :class:`TrainMetrics`: metrics.jsonl and TensorBoard rows with the throughput; the progress bar.
- :class:`StopOnDivergence`: :class:`TrainingDiverged` after ``train.max_nonfinite_steps`` skipped
  steps in a row, naming the last checkpoint.
- :class:`Checkpoints` (every ``train.checkpoint_every`` steps) and its ``raise_failed_save``
  (every step): a fresh run saves its initial parameters first; every way out but an error saves
  the last step, so ``--resume`` continues the same schedule.
- :class:`TauCurve`: validation tau every ``eval.curve_every_minutes`` of training, off the clock;
  each measurement goes to :class:`KeepBest`, which keeps the drafter with the highest validation
  tau so far in ``<run>/best/`` (beside the last ``train.keep_checkpoints``, never rotated out).
- :class:`StopAt`: an explicit last step (``stop_at_step``) and ``train.time_limit_minutes``.

The last checkpoint of a diverging run holds only updates that passed the step check: saves refuse
non-finite parameters, skipped steps never change them, and no checkpoint is written while steps
are being skipped. Throughput excludes the first (compiling) step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal

import numpy as np
from tqdm import tqdm

from dflash_jax import distributed
from dflash_jax.cli import UserError
from dflash_jax.training.run_config import TrainSection
from dflash_jax.training.trainer import StepInfo, Trainer, skip_reason

log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class StopFlag:
    """Signal handler that records the first signal and calls ``on_stop(name)``; a second
    signal aborts (KeyboardInterrupt)."""

    def __init__(self, on_stop=None):
        self.stop = False
        self.reason = ""
        self.signum: int | None = None
        self.on_stop = on_stop

    def __call__(self, signum, frame):
        if self.stop:  # second signal: give up waiting
            raise KeyboardInterrupt
        self.stop = True
        self.signum = signum
        self.reason = signal.Signals(signum).name
        if self.on_stop is not None:
            self.on_stop(self.reason)


class StopOnSignal:
    """SIGTERM and SIGINT, while the loop runs, ask the trainer to stop after the current step
    (or wait for data); the handlers before the loop come back when it ends."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.flag = StopFlag()

    def start(self, trainer: Trainer) -> None:
        self.flag = StopFlag(trainer.request_stop)
        self._previous = {s: signal.signal(s, self.flag) for s in self.SIGNALS}

    def __call__(self, info: StepInfo) -> None:
        pass  # the handler asks for the stop itself

    def end(self, trainer: Trainer, error) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if error is None and self.flag.stop:
            log.warning(
                "%s received: saving a checkpoint at step %d and exiting",
                self.flag.reason,
                trainer.state.step,
            )

    @property
    def signum(self) -> int | None:
        """The signal that stopped the run, if one did."""
        return self.flag.signum


def _follow_time_limit(
    bar, train: TrainSection, step: int, start_step: int, t_train: float, compiled_at, now
):
    """With a time limit, the bar's total (and so its ETA) is the step the limit will stop at,
    from the mean compiled step time so far, never past ``train.steps``."""
    left = 60 * train.time_limit_minutes - (now - t_train)
    done_since_compile = step - start_step - 1
    if compiled_at is None or done_since_compile < 1:
        return
    per_step = (now - compiled_at) / done_since_compile
    total = min(train.steps, step + max(0, math.ceil(left / per_step)))
    if total != bar.total:
        bar.total = total
        bar.refresh()


class TrainMetrics:
    """The step's metrics to ``logger`` (metrics.jsonl, TensorBoard) every ``train.log_every``
    steps, at ``train.steps`` and at every skipped step, with ``tokens_per_s`` and
    ``step_time_s`` over the steps since the last row (the compiling step excluded); the progress
    bar (off with ``quiet``), whose total follows a time limit. ``last``: the last row logged."""

    def __init__(self, train: TrainSection, logger, *, quiet: bool = False):
        self.train, self.logger, self.quiet = train, logger, quiet
        self.last: dict = {}

    def start(self, trainer: Trainer) -> None:
        self.start_step = trainer.state.step
        self.bar = tqdm(
            total=self.train.steps, initial=self.start_step, desc="train", unit="step", disable=self.quiet
        )
        self.window_t, self.window_tokens = trainer.clock.now(), 0

    def __call__(self, info: StepInfo) -> None:
        train, clock, step = self.train, info.clock, info.step
        if step == clock.compiled_step:  # the window opens after compiling
            self.window_t, self.window_tokens = clock.compiled_at, 0
        else:
            self.window_tokens += int(info.metrics["tokens"])
        self.bar.update(1)
        if train.time_limit_minutes is not None:
            _follow_time_limit(
                self.bar, train, step, self.start_step, clock.start, clock.compiled_at, clock.now()
            )
        if step % train.log_every == 0 or step == train.steps or info.skipped_in_a_row:
            dt = max(clock.now() - self.window_t, 1e-9)
            last = {k: np.asarray(v) for k, v in info.metrics.items()}
            last["tokens_per_s"] = self.window_tokens / dt
            last["step_time_s"] = dt / train.log_every
            self.logger.log(step, last)
            self.bar.set_postfix(loss=f"{float(last['loss']):.3f}", streak=f"{float(last['streak']):.2f}")
            self.last = last
            self.window_t, self.window_tokens = clock.now(), 0

    def end(self, trainer: Trainer, error) -> None:
        self.bar.close()


class Checkpoints:
    """Saves through ``checkpointer`` (``checkpoint.Checkpointer``) with ``config`` (the resolved
    run config): a fresh run's initial parameters (step 0: the fallback a diverging run keeps,
    finite by construction) at the start; after a step on the steps it is added for, unless steps
    are being skipped; the last step when the loop ends without an error. Saves are collective:
    every process's data position goes into the checkpoint. ``last_saved``: the newest step saved."""

    def __init__(self, checkpointer, config: dict):
        self.checkpointer, self.config = checkpointer, config
        self.last_saved: int | None = None

    def start(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.last_saved = trainer.state.step if trainer.state.resumed else None  # that checkpoint exists
        if self.last_saved is None:
            self._save(0, force=True)

    def __call__(self, info: StepInfo) -> None:
        if not info.skipped_in_a_row:
            self._save(info.step, force=False)

    def raise_failed_save(self, info: StepInfo) -> None:
        """Raise naming the step if an asynchronous save failed (cheap: run after every step)."""
        self.checkpointer.check()

    def end(self, trainer: Trainer, error) -> None:
        if error is None and self.last_saved != trainer.state.step:
            try:
                self._save(trainer.state.step, force=True)
            except BaseException:
                with contextlib.suppress(Exception):  # the failed save is the error to report
                    self.checkpointer.close()
                raise
        self.checkpointer.close()

    def _save(self, step: int, *, force: bool) -> None:
        from dflash_jax.data.shards import merge_states

        state = self.trainer.state
        data_state = merge_states(distributed.allgather_json(self.trainer.data_state()))
        self.checkpointer.save(step, state.drafter, state.optimizer, data_state, self.config, force=force)
        self.last_saved = step


class StopOnDivergence:
    """:class:`TrainingDiverged` once ``train.max_nonfinite_steps`` steps in a row applied no
    update, naming the step and the checkpoint kept (``checkpoints.last_saved``)."""

    def __init__(self, train: TrainSection, checkpoints: Checkpoints):
        self.train, self.checkpoints = train, checkpoints

    def __call__(self, info: StepInfo) -> None:
        n, limit = info.skipped_in_a_row, self.train.max_nonfinite_steps
        if n < limit:
            return
        kept = self.checkpoints.last_saved
        raise TrainingDiverged(
            f"{n} steps in a row skipped (train.max_nonfinite_steps={limit}; "
            f"no update was applied for them), the last: {skip_reason(info.metrics, self.train)}: stopped at "
            f"step {info.step}; kept checkpoint: step {kept} (made only of steps that passed the "
            f"check). Lower train.learning_rate and --resume-step {kept}"
        )


class TauCurve:
    """``measure(step)`` (held-out tau for the curve) once ``every_minutes`` of training passed
    since the last one (or the start); its time is not training time (the clock pauses)."""

    def __init__(self, measure, every_minutes: float):
        self.measure, self.every_s = measure, 60 * every_minutes

    def start(self, trainer: Trainer) -> None:
        self.last = trainer.clock.start

    def __call__(self, info: StepInfo) -> None:
        clock = info.clock
        if clock.now() - self.last >= self.every_s:
            with clock.paused():
                self.measure(info.step)
            self.last = clock.now()


class KeepBest:
    """Keeps the run's best drafter by validation tau: ``consider(step, report)``, after each
    validation measurement (the curve's points, ``HeldoutReports.tau_curve``), saves the live
    ``drafter`` at that step through ``best`` (``checkpoint.BestCheckpoint``, with ``config``, the
    resolved run config) when its tau is higher than every earlier one's (a tie keeps the earlier);
    a resumed run compares against the record it kept. ``record``: the best so far (``step``,
    ``validation_tau``, ``tau_stderr``, ``num_prompts``, ``method``) or None."""

    def __init__(self, best, drafter, config: dict):
        self.best, self.drafter, self.config = best, drafter, config
        self.record = best.record()

    def consider(self, step: int, report: dict) -> bool:
        """Whether ``report`` (a tau report of ``training.evaluation``) made ``step`` the best."""
        tau = float(report["tau"])
        if self.record is not None and tau <= self.record["validation_tau"]:
            return False
        record = {
            "validation_tau": tau,
            "tau_stderr": report.get("tau_stderr"),
            "num_prompts": report.get("num_prompts"),
            "method": report.get("method"),
        }
        self.best.save(step, self.drafter, self.config, record)
        previous, self.record = self.record, {"step": int(step), **record}
        log.info(
            "step %d: validation tau %.3f is the best so far (before: %s); kept in %s",
            step,
            tau,
            "none" if previous is None else f"{previous['validation_tau']:.3f} at step {previous['step']}",
            self.best.directory,
        )
        return True

    def summary(self) -> dict | None:
        """The best kept, for the run's result: its record and the path eval and export take."""
        if self.record is None:
            return None
        return {**self.record, "path": str(self.best.directory / str(self.record["step"]))}


class StopAt:
    """Stop after the step that passes ``minutes`` of training (``train.time_limit_minutes``) or
    reaches ``step`` (a ``stop_at_step`` ends an invocation early, exactly like a preemption)."""

    def __init__(self, *, step: int | None = None, minutes: float | None = None):
        self.step, self.minutes = step, minutes

    def __call__(self, info: StepInfo) -> None:
        if self.minutes is not None and info.clock.elapsed() > 60 * self.minutes:
            log.info("time limit of %.1f min reached at step %d", self.minutes, info.step)
            info.trainer.request_stop("time limit")
        elif self.step is not None and info.step >= self.step:
            info.trainer.request_stop(f"stop at step {self.step}")
