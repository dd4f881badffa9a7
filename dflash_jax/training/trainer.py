"""The training loop as an object: a :class:`Trainer` owns the step, the training state and the clock;
what a run does around its steps is a hook (``training/hooks.py``: signals, metrics, checkpoints,
the divergence stop, the tau curve, the stop at a step or a time limit; ``training/schedule.py``:
the learning rate, whose length a time budget sets).

A step: the next batch (waited for on a helper thread, in slices, so a stop request is honoured
while the data pipeline is busy or stuck; :class:`DataStalled` when none comes within
``data.max_wait_s``), the jitted step at the schedule's rate and a key folded from the step, then
the hooks, in the order they were added, each on the steps divisible by its ``every``, with a
:class:`StepInfo`. A step whose loss or gradients are not finite, or whose update is blown up
(``train.max_update_ratio``), applies no update (``step.apply_train_step``): the trainer counts it,
says why (:func:`skip_reason`) and hands the streak to the hooks.

The loop ends at ``train.steps``, when the data runs out, or after the step in which something
called :meth:`Trainer.request_stop` (a hook, a signal handler; also while waiting for data).

A hook is ``hook(info)``; an object may also define ``start(trainer)`` (before the first step)
and ``end(trainer, error)`` (once the loop is over, however it ended: ``error`` is the exception
that ended it, else None). Ends run in the order the hooks were added; a failing end fails the run
unless the run already failed (that error is the one to report).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from dflash_jax.cli import UserError
from dflash_jax.training.run_config import TrainSection

log = logging.getLogger(__name__)


class DataStalled(UserError):
    """No batch arrived within ``data.max_wait_s``."""


def skip_reason(metrics, train: TrainSection) -> str:
    """Why the step check (``step.apply_train_step``) rejected a step, in words."""
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return f"loss {loss}, grad norm {grad_norm}: not finite"
    ratio = float(metrics.get("update_ratio", 0.0))
    if not math.isfinite(ratio) or ratio > train.max_update_ratio:
        return (
            f"loss {loss:.4g}: blown-up update, {ratio:.3g} times the parameters' norm "
            f"(train.max_update_ratio={train.max_update_ratio:g})"
        )
    return f"loss {loss:.4g}, grad norm {grad_norm:.4g}: updated parameters not finite"


class BatchWaiter:
    """``next(data_iter)`` on a helper thread, waited for in short slices: a stop request is
    honoured while the pipeline is busy or stuck, and no batch within ``max_wait_s`` fails the
    run. ``get_state()`` is the iterator's state after the last batch handed out, so a checkpoint
    taken while a fetch is pending resumes with exactly that batch."""

    def __init__(self, data_iter, *, max_wait_s: float | None, poll_s: float = 0.2):
        self.it, self.max_wait_s, self.poll_s = data_iter, max_wait_s, poll_s
        self._state = data_iter.get_state()
        self._box: list = []
        self._thread: threading.Thread | None = None

    def _fetch(self, box):
        try:
            box.append(("batch", next(self.it)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the loop's thread
            box.append(("error", e))

    def next(self, stopping: Callable[[], bool], step: int):
        """The next batch; None when ``stopping()`` turned true while waiting; raises
        StopIteration at the end of the data and :class:`DataStalled` after ``max_wait_s``."""
        if self._thread is None:
            self._box = []
            self._thread = threading.Thread(target=self._fetch, args=(self._box,), daemon=True)
            self._thread.start()
        t0 = time.perf_counter()
        while self._thread.is_alive():
            self._thread.join(self.poll_s)
            if stopping() and self._thread.is_alive():
                return None
            waited = time.perf_counter() - t0
            if self.max_wait_s is not None and waited > self.max_wait_s and self._thread.is_alive():
                raise DataStalled(
                    f"no training batch for {waited:.0f} s at step {step} (data.max_wait_s="
                    f"{self.max_wait_s:g}): the data pipeline drops or stalls on everything; see the "
                    "'dropping record' warnings above for the filter (data.max_length, "
                    "data.min_loss_tokens, the chat template), or raise data.max_wait_s"
                )
        self._thread = None
        kind, value = self._box[0]
        if kind == "error":
            raise value
        self._state = self.it.get_state()
        return value

    def get_state(self):
        return self._state


class TrainClock:
    """Training seconds. It starts with the loop and stops while a hook measures something that
    is not training (``with clock.paused():``, the tau curve), so the throughput, the schedule's
    step time and the time limit count training only. ``compiled_at``/``compiled_step``: when the
    first (compiling) step of this invocation ended; step times are measured from there."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock, self._paused = clock, 0.0
        self.start = clock()
        self.compiled_at: float | None = None
        self.compiled_step: int | None = None

    def now(self) -> float:
        return self._clock() - self._paused

    def elapsed(self) -> float:
        """Training seconds since the loop started."""
        return self.now() - self.start

    @contextlib.contextmanager
    def paused(self):
        t0 = self._clock()
        try:
            yield
        finally:
            self._paused += self._clock() - t0


@dataclass
class TrainState:
    """What the steps change and a checkpoint keeps: the drafter and its optimizer (updated in
    place by the step) and the number of steps done; ``resumed``: restored from the checkpoint of
    ``step`` (a fresh run's first checkpoint is its initial parameters)."""

    drafter: Any
    optimizer: Any
    step: int = 0
    resumed: bool = False


@dataclass(frozen=True)
class StepInfo:
    """What a hook sees after a step."""

    step: int  # steps done, this one included (the step's number, 1-based)
    metrics: dict  # what the step returned
    learning_rate: float  # the rate it ran at
    skipped_in_a_row: int  # steps up to this one that applied no update (0: this one updated)
    trainer: Trainer

    @property
    def clock(self) -> TrainClock:
        return self.trainer.clock


@dataclass
class LoopResult:
    step: int
    train_seconds: float
    skipped_steps: int
    stop_reason: str | None  # what asked the loop to stop, if anything did


@dataclass
class _Hook:
    fn: Callable[[StepInfo], Any]
    every: int

    def start(self, trainer):
        if hasattr(self.fn, "start"):
            self.fn.start(trainer)

    def end(self, trainer, error):
        if hasattr(self.fn, "end"):
            self.fn.end(trainer, error)


class Trainer:
    """Runs ``train_step(drafter, optimizer, target, batch, key, lr)`` (``put`` turns a host
    batch into the step's input, ``learning_rate(step)`` is the rate of 0-based update ``step``)
    from a :class:`TrainState` until ``train.steps``, the end of the data or a stop request."""

    def __init__(
        self,
        train: TrainSection,
        train_step,
        *,
        target,
        put: Callable,
        learning_rate: Callable[[int], float],
        max_wait_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config, self.train_step, self.target, self.put = train, train_step, target, put
        self.learning_rate, self.max_wait_s, self._clock = learning_rate, max_wait_s, clock
        self.hooks: list[_Hook] = []
        self.stop_reason: str | None = None

    def add_hook(self, hook: Callable[[StepInfo], Any], *, every: int = 1) -> None:
        """Call ``hook(info)`` after every step whose number is a multiple of ``every``."""
        if every < 1:
            raise ValueError(f"a hook's every must be >= 1, got {every}")
        self.hooks.append(_Hook(hook, every))

    def request_stop(self, reason: str) -> None:
        """End the loop after the current step (or the current wait for data)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def data_state(self):
        """The data iterator's position after the last batch trained on (what a checkpoint keeps)."""
        return self.batches.get_state()

    def train(self, state: TrainState, data_iter) -> LoopResult:
        self.state, self.clock = state, TrainClock(self._clock)
        self.batches = BatchWaiter(data_iter, max_wait_s=self.max_wait_s)
        self.key, self.skipped_in_a_row, self.skipped_steps = jax.random.key(self.config.seed), 0, 0
        start_step, started, error = state.step, [], None
        try:
            for hook in self.hooks:
                started.append(hook)
                hook.start(self)
            while state.step < self.config.steps:
                batch = self._next_batch(start_step)
                if batch is None:
                    break
                info = self._step(batch)
                for hook in self.hooks:
                    if info.step % hook.every == 0:
                        hook.fn(info)
                if self.stop_reason is not None:
                    break
        except BaseException as e:
            error = e
            raise
        finally:
            self._end(started, error)
        return LoopResult(state.step, self.clock.elapsed(), self.skipped_steps, self.stop_reason)

    def _next_batch(self, start_step: int):
        step = self.state.step
        try:
            batch = self.batches.next(lambda: self.stop_reason is not None, step)
        except StopIteration:
            if step == start_step:
                raise DataStalled("the training data yielded no batch at all") from None
            log.info("data exhausted at step %d", step)
            return None
        if batch is None:
            log.warning("%s received while waiting for data at step %d", self.stop_reason, step)
        return batch

    def _step(self, batch) -> StepInfo:
        state = self.state
        lr = np.float32(self.learning_rate(state.step))
        key = jax.random.fold_in(self.key, state.step)
        metrics = self.train_step(state.drafter, state.optimizer, self.target, self.put(batch), key, lr)
        state.step += 1
        if int(metrics["skipped"]):
            self.skipped_in_a_row += 1
            self.skipped_steps += 1
            log.warning(
                "step %d: %s, no update applied (%d in a row)",
                state.step,
                skip_reason(metrics, self.config),
                self.skipped_in_a_row,
            )
        else:
            self.skipped_in_a_row = 0
        if self.clock.compiled_at is None:
            self.clock.compiled_at, self.clock.compiled_step = self.clock.now(), state.step
        return StepInfo(state.step, metrics, float(lr), self.skipped_in_a_row, self)

    def _end(self, started: list[_Hook], error: BaseException | None) -> None:
        failure = None
        for hook in started:
            try:
                hook.end(self, error)
            except BaseException as e:  # noqa: BLE001 - every hook ends; the first failure is raised
                failure = failure or e
        if failure is not None and error is None:
            raise failure
