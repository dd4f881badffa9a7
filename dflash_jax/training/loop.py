"""The training loop: steps until done, with stop flags, throughput, metrics and checkpoints.

It stops at ``train.steps``, when the data runs out, at ``train.time_limit_minutes``, at an
explicit ``stop_at_step``, or on SIGTERM/SIGINT (a second signal aborts); every way out saves a
checkpoint, so ``--resume`` continues the same schedule. A non-finite loss raises, naming the last
good checkpoint. Throughput excludes the first (compiling) step.

Learning rate: linear warm-up over ``train.warmup_steps``, then a cosine down to
``end_lr_ratio * learning_rate`` at the schedule's last step. That last step is ``train.steps``,
or, with ``train.time_limit_minutes``, the number of steps that fit in the budget, estimated once
from the measured step time after compilation and ``TIMED_STEPS`` more steps (so a time-limited
run ends with a decayed rate instead of stopping near its peak).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from tqdm import tqdm

from dflash_jax.training.run_config import TrainSection

log = logging.getLogger(__name__)


class StopFlag:
    """Signal handler that asks the loop to checkpoint and stop; a second signal aborts."""

    def __init__(self):
        self.stop = False
        self.reason = ""

    def __call__(self, signum, frame):
        if self.stop:  # second signal: give up waiting
            raise KeyboardInterrupt
        self.stop = True
        self.reason = signal.Signals(signum).name


TIMED_STEPS = 3  # steps after the compiling one that time the step for the budget estimate


@dataclass
class LoopResult:
    step: int
    interrupted: bool
    train_seconds: float
    last: dict  # the last logged train metrics (empty if none was logged)
    decay_steps: int  # the step at which the learning-rate schedule ends


def learning_rate(train: TrainSection, step: int, decay_steps: int) -> float:
    """The rate of update ``step`` (0-based): what ``optax.warmup_cosine_decay_schedule(0, peak,
    warmup_steps, decay_steps, end)`` gives, with ``decay_steps`` chosen at run time."""
    peak, warmup = train.learning_rate, min(train.warmup_steps, train.steps - 1)
    end = peak * train.end_lr_ratio
    if step < warmup:
        return peak * step / warmup
    span = max(decay_steps - warmup, 1)
    progress = min(step - warmup, span) / span
    return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def steps_that_fit(step: int, elapsed_s: float, step_time_s: float, limit_s: float) -> int:
    """The step count reached when the budget ``limit_s`` runs out, at ``step_time_s`` per step."""
    return step + max(0, int((limit_s - elapsed_s) / max(step_time_s, 1e-9)))


def train_loop(
    train: TrainSection,
    *,
    train_step,
    drafter,
    optimizer,
    target,
    data_iter,
    put,
    save,
    logger,
    start_step: int = 0,
    stop_at_step: int | None = None,
    quiet: bool = False,
    decay_steps: int | None = None,
    on_decay_steps: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> LoopResult:
    """Run ``train_step`` from ``start_step``; ``put`` makes a host batch global, ``save(step,
    force)`` writes a checkpoint, ``logger.log(step, metrics)`` records train metrics.

    ``decay_steps``: the schedule's length when already known (a resumed run); else it is
    ``train.steps`` or estimated from the time budget, and ``on_decay_steps`` is told the estimate
    (to keep it with the checkpoints). ``clock``: seconds (injectable for tests)."""
    stop = StopFlag()
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    base_key = jax.random.key(train.seed)
    bar = tqdm(total=train.steps, initial=start_step, desc="train", unit="step", disable=quiet)
    step, last_saved, t_train = start_step, None, clock()
    window_t, window_tokens, compiled_at = clock(), 0, None
    limit = train.time_limit_minutes
    estimate = decay_steps is None and limit is not None
    decay_steps = train.steps if decay_steps is None else decay_steps
    last = {}
    try:
        while step < train.steps:
            try:
                batch = next(data_iter)
            except StopIteration:
                log.info("data exhausted at step %d", step)
                break
            lr = np.float32(learning_rate(train, step, decay_steps))
            metrics = train_step(
                drafter, optimizer, target, put(batch), jax.random.fold_in(base_key, step), lr
            )
            step += 1
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at step {step}; stopping. Last good checkpoint: step {last_saved}"
                )
            if compiled_at is None:
                compiled_at, compiled_step = clock(), step
                window_t, window_tokens = compiled_at, 0
            else:
                window_tokens += int(metrics["tokens"])
            if estimate and step - compiled_step >= TIMED_STEPS:
                now = clock()
                fit = steps_that_fit(
                    step, now - t_train, (now - compiled_at) / (step - compiled_step), 60 * limit
                )
                warmup = min(train.warmup_steps, train.steps - 1)
                decay_steps, estimate = min(train.steps, max(fit, warmup + 1)), False
                log.info("learning rate decays over %d steps (what fits in %.1f min)", decay_steps, limit)
                if on_decay_steps is not None:
                    on_decay_steps(decay_steps)
            bar.update(1)
            if step % train.log_every == 0 or step == train.steps:
                dt = max(clock() - window_t, 1e-9)
                last = {k: np.asarray(v) for k, v in metrics.items()}
                last["tokens_per_s"] = window_tokens / dt
                last["step_time_s"] = dt / train.log_every
                logger.log(step, last)
                bar.set_postfix(loss=f"{loss:.3f}", streak=f"{float(last['streak']):.2f}")
                window_t, window_tokens = clock(), 0
            if step % train.checkpoint_every == 0:
                save(step, force=False)
                last_saved = step
            if limit is not None and clock() - t_train > 60 * limit:
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
        save(step, force=True)
    return LoopResult(step, stop.stop, clock() - t_train, last, decay_steps)
