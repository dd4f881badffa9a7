"""The training loop: steps until done, with stop flags, throughput, metrics and checkpoints.

It stops at ``train.steps``, when the data runs out, at ``train.time_limit_minutes``, at an
explicit ``stop_at_step``, or on SIGTERM/SIGINT (a second signal aborts), also while it waits for
data; every such way out saves a checkpoint, so ``--resume`` continues the same schedule.

A fresh run checkpoints its initial parameters (step 0) first. A step whose loss or gradients are
not finite, or whose update is blown up (``train.max_update_ratio``), applies no update (see
``step.apply_train_step``) and is counted; after ``train.max_nonfinite_steps`` of them in a row
the run stops with :class:`TrainingDiverged`, naming the step and the last checkpoint, which holds
only updates that passed that check (saves refuse non-finite parameters, skipped steps never
change them, and no checkpoint is written while steps are being skipped). Throughput excludes
the first (compiling) step.

Learning rate: linear warm-up over ``train.warmup_steps``, then a cosine down to
``end_lr_ratio * learning_rate`` at the schedule's last step. That last step is ``train.steps``,
or, with ``train.time_limit_minutes``, the number of steps that fit in the budget, estimated from
the measured step time after compilation and ``TIMED_STEPS`` more steps, and once more after
``REFINE_FRACTION`` of the budget, so a time-limited run ends with a decayed rate instead of
stopping near its peak (the first steps run faster than the average one, which pays for
checkpoint saves and logging: from the first estimate alone the demo's schedule was 8 % longer
than its run).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from tqdm import tqdm

from dflash_jax.cli import UserError
from dflash_jax.training.run_config import TrainSection

log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class DataStalled(UserError):
    """No batch arrived within ``data.max_wait_s``."""


class StopFlag:
    """Signal handler that asks the loop to checkpoint and stop; a second signal aborts."""

    def __init__(self):
        self.stop = False
        self.reason = ""
        self.signum: int | None = None

    def __call__(self, signum, frame):
        if self.stop:  # second signal: give up waiting
            raise KeyboardInterrupt
        self.stop = True
        self.signum = signum
        self.reason = signal.Signals(signum).name


TIMED_STEPS = 3  # steps after the compiling one that time the step for the budget estimate
# The estimate is taken again once this fraction of the time limit has been trained: its mean step
# then includes checkpoint saves and logging. On the demo's 16.7 minutes (BENCHMARKS.md "The
# schedule's length") steps 10-50 took 0.169 s, the whole run 0.178 s: the first estimate alone
# decayed over 6,005 steps where 5,570 fit. A shift this early changes the rate by < 1 %.
REFINE_FRACTION = 0.1


class BatchWaiter:
    """``next(data_iter)`` on a helper thread, waited for in short slices: a stop signal is
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

    def next(self, stop: StopFlag, step: int):
        """The next batch; None when a stop was requested while waiting; raises StopIteration
        at the end of the data and :class:`DataStalled` after ``max_wait_s``."""
        if self._thread is None:
            self._box = []
            self._thread = threading.Thread(target=self._fetch, args=(self._box,), daemon=True)
            self._thread.start()
        t0 = time.perf_counter()
        while self._thread.is_alive():
            self._thread.join(self.poll_s)
            if stop.stop and self._thread.is_alive():
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


@dataclass
class LoopResult:
    step: int
    interrupted: bool
    train_seconds: float
    last: dict  # the last logged train metrics (empty if none was logged)
    decay_steps: int  # the step at which the learning-rate schedule ends
    signum: int | None = None  # the signal that stopped the run, if one did
    skipped_steps: int = 0


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


def training_minutes_in_budget(
    run_minutes: float,
    elapsed_s: float,
    final_eval_s: float,
    curve_eval_s: float = 0.0,
    curve_every_minutes: float | None = None,
    margin_s: float = 30.0,
) -> float:
    """The training minutes that end a run within ``run_minutes`` of its start, ``elapsed_s`` in:
    what is left after the final evaluation (``final_eval_s``) and a margin (the last checkpoint,
    the plot), shared with the curve evaluations (``curve_eval_s`` each, one every
    ``curve_every_minutes`` of training; their time is not training time); <= 0 when nothing is left."""
    left = 60 * run_minutes - elapsed_s - final_eval_s - margin_s
    if curve_every_minutes:
        left /= 1 + curve_eval_s / (60 * curve_every_minutes)
    return left / 60


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
    resumed: bool = False,
    stop_at_step: int | None = None,
    quiet: bool = False,
    max_wait_s: float | None = None,
    check_saves=None,
    decay_steps: int | None = None,
    on_decay_steps: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_eval: Callable[[int], None] | None = None,
    eval_every_s: float | None = None,
) -> LoopResult:
    """Run ``train_step`` from ``start_step`` (``resumed``: restored from its checkpoint); ``put`` makes a host batch global, ``save(step,
    force, data_state)`` writes a checkpoint, ``logger.log(step, metrics)`` records train metrics,
    ``check_saves()`` (after every step) raises if an asynchronous save failed; ``max_wait_s``
    bounds the wait for one batch.

    ``decay_steps``: the schedule's length when already known (a resumed run); else it is
    ``train.steps`` or estimated from the time budget, and ``on_decay_steps`` is told the estimate
    (to keep it with the checkpoints). ``clock``: seconds (injectable for tests)."""
    stop = StopFlag()
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    base_key = jax.random.key(train.seed)
    waiter = BatchWaiter(data_iter, max_wait_s=max_wait_s)
    step, t_train = start_step, clock()
    last_saved = start_step if resumed else None  # a resumed run's checkpoint exists
    if last_saved is None:  # the fallback a diverging run keeps: finite by construction
        save(0, True, waiter.get_state())
        last_saved = 0
    bar = tqdm(total=train.steps, initial=start_step, desc="train", unit="step", disable=quiet)
    window_t, window_tokens, compiled_at = clock(), 0, None
    last, in_a_row, skipped_total = {}, 0, 0
    limit = train.time_limit_minutes
    last_eval = t_train
    # the schedule's length from the step time: after TIMED_STEPS, then over REFINE_FRACTION of the budget
    estimates_left = 2 if decay_steps is None and limit is not None else 0
    decay_steps = train.steps if decay_steps is None else decay_steps
    try:
        while step < train.steps:
            try:
                batch = waiter.next(stop, step)
            except StopIteration:
                if step == start_step:
                    raise DataStalled("the training data yielded no batch at all") from None
                log.info("data exhausted at step %d", step)
                break
            if batch is None:
                log.warning("%s received while waiting for data at step %d", stop.reason, step)
                break
            lr = np.float32(learning_rate(train, step, decay_steps))
            metrics = train_step(
                drafter, optimizer, target, put(batch), jax.random.fold_in(base_key, step), lr
            )
            step += 1
            loss = float(metrics["loss"])
            if int(metrics["skipped"]):
                in_a_row += 1
                skipped_total += 1
                log.warning(
                    "step %d: %s, no update applied (%d in a row)",
                    step,
                    skip_reason(metrics, train),
                    in_a_row,
                )
            else:
                in_a_row = 0
            if compiled_at is None:
                compiled_at, compiled_step = clock(), step
                window_t, window_tokens = compiled_at, 0
            else:
                window_tokens += int(metrics["tokens"])
            now = clock()
            again = estimates_left == 1
            if (estimates_left == 2 and step - compiled_step >= TIMED_STEPS) or (
                again and now - compiled_at >= REFINE_FRACTION * 60 * limit
            ):
                estimates_left -= 1
                fit = steps_that_fit(
                    step, now - t_train, (now - compiled_at) / (step - compiled_step), 60 * limit
                )
                warmup = min(train.warmup_steps, train.steps - 1)
                new_decay = min(train.steps, max(fit, warmup + 1))
                if not again or new_decay != decay_steps:
                    decay_steps = new_decay
                    log.info(
                        "learning rate decays over %d steps (what fits in %.1f min%s)",
                        decay_steps,
                        limit,
                        ", measured again" if again else "",
                    )
                    if on_decay_steps is not None:
                        on_decay_steps(decay_steps)
            bar.update(1)
            if train.time_limit_minutes is not None:
                _follow_time_limit(bar, train, step, start_step, t_train, compiled_at, clock())
            if step % train.log_every == 0 or step == train.steps or in_a_row:
                dt = max(clock() - window_t, 1e-9)
                last = {k: np.asarray(v) for k, v in metrics.items()}
                last["tokens_per_s"] = window_tokens / dt
                last["step_time_s"] = dt / train.log_every
                logger.log(step, last)
                bar.set_postfix(loss=f"{loss:.3f}", streak=f"{float(last['streak']):.2f}")
                window_t, window_tokens = clock(), 0
            if in_a_row >= train.max_nonfinite_steps:
                raise TrainingDiverged(
                    f"{in_a_row} steps in a row skipped (train.max_nonfinite_steps={train.max_nonfinite_steps}; "
                    f"no update was applied for them), the last: {skip_reason(metrics, train)}: stopped at "
                    f"step {step}; kept checkpoint: step {last_saved} (made only of steps that passed the "
                    f"check). Lower train.learning_rate and --resume-step {last_saved}"
                )
            if step % train.checkpoint_every == 0 and not in_a_row:
                save(step, False, waiter.get_state())
                last_saved = step
            if check_saves is not None:
                check_saves()
            if on_eval is not None and eval_every_s and clock() - last_eval >= eval_every_s:
                t0 = clock()
                on_eval(step)
                spent = clock() - t0
                t_train, window_t, last_eval = t_train + spent, window_t + spent, clock()
                if compiled_at is not None:
                    compiled_at += spent
            if limit is not None and clock() - t_train > 60 * limit:
                log.info("time limit of %.1f min reached at step %d", limit, step)
                break
            if stop_at_step is not None and step >= stop_at_step:
                break
            if stop.stop:
                break
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    if stop.stop:
        log.warning("%s received: saving a checkpoint at step %d and exiting", stop.reason, step)
    if last_saved != step:
        save(step, True, waiter.get_state())
    return LoopResult(step, stop.stop, clock() - t_train, last, decay_steps, stop.signum, skipped_total)
