"""The training loop: steps until done, with stop flags, throughput, metrics and checkpoints.

It stops at ``train.steps``, when the data runs out, at ``train.time_limit_minutes``, at an
explicit ``stop_at_step``, or on SIGTERM/SIGINT (a second signal aborts); every way out saves a
checkpoint, so ``--resume`` continues the same schedule. A non-finite loss raises, naming the last
good checkpoint. Throughput excludes the first (compiling) step.
"""

from __future__ import annotations

import logging
import math
import signal
import time
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


@dataclass
class LoopResult:
    step: int
    interrupted: bool
    train_seconds: float
    last: dict  # the last logged train metrics (empty if none was logged)


def _follow_time_limit(bar, train: TrainSection, step: int, start_step: int, t_train: float, compiled_at):
    """With a time limit, the bar's total (and so its ETA) is the step the limit will stop at,
    from the mean compiled step time so far, never past ``train.steps``."""
    now = time.perf_counter()
    left = 60 * train.time_limit_minutes - (now - t_train)
    done_since_compile = step - start_step - 1
    if compiled_at is None or done_since_compile < 1:
        return
    per_step = (now - compiled_at) / done_since_compile
    total = min(train.steps, step + max(0, math.ceil(left / per_step)))
    if total != bar.total:
        bar.total = total
        bar.refresh()


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
) -> LoopResult:
    """Run ``train_step`` from ``start_step``; ``put`` makes a host batch global, ``save(step,
    force)`` writes a checkpoint, ``logger.log(step, metrics)`` records train metrics."""
    stop = StopFlag()
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    base_key = jax.random.key(train.seed)
    bar = tqdm(total=train.steps, initial=start_step, desc="train", unit="step", disable=quiet)
    step, last_saved, t_train = start_step, None, time.perf_counter()
    window_t, window_tokens, compiled_at = time.perf_counter(), 0, None
    last = {}
    try:
        while step < train.steps:
            try:
                batch = next(data_iter)
            except StopIteration:
                log.info("data exhausted at step %d", step)
                break
            metrics = train_step(drafter, optimizer, target, put(batch), jax.random.fold_in(base_key, step))
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
            if train.time_limit_minutes is not None:
                _follow_time_limit(bar, train, step, start_step, t_train, compiled_at)
            if step % train.log_every == 0 or step == train.steps:
                dt = max(time.perf_counter() - window_t, 1e-9)
                last = {k: np.asarray(v) for k, v in metrics.items()}
                last["tokens_per_s"] = window_tokens / dt
                last["step_time_s"] = dt / train.log_every
                logger.log(step, last)
                bar.set_postfix(loss=f"{loss:.3f}", streak=f"{float(last['streak']):.2f}")
                window_t, window_tokens = time.perf_counter(), 0
            if step % train.checkpoint_every == 0:
                save(step, force=False)
                last_saved = step
            limit = train.time_limit_minutes
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
        save(step, force=True)
    return LoopResult(step, stop.stop, time.perf_counter() - t_train, last)
