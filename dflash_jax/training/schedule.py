"""The learning rate and the time budget that sets its length.

Learning rate: linear warm-up over ``train.warmup_steps``, then a cosine down to
``end_lr_ratio * learning_rate`` at the schedule's last step. That last step is ``train.steps``,
or, with ``train.time_limit_minutes``, the number of steps that fit in the budget, estimated from
the measured step time after compilation and ``TIMED_STEPS`` more steps, and once more after
``REFINE_FRACTION`` of the budget, so a time-limited run ends with a decayed rate instead of
stopping near its peak (the first steps run faster than the average one, which pays for
checkpoint saves and logging: from the first estimate alone the demo's schedule was 8 % longer
than its run). The estimate is kept in the run dir (:class:`ScheduleFile`), so a resumed run
follows the same schedule.

``train.run_minutes`` (the whole run, evaluations included) becomes a training time limit before
the loop starts (:func:`within_run_budget`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from dflash_jax.config_io import ConfigError
from dflash_jax.training.run_config import RunConfig, TrainSection

log = logging.getLogger(__name__)

TIMED_STEPS = 3  # steps after the compiling one that time the step for the budget estimate
# The estimate is taken again once this fraction of the time limit has been trained: its mean step
# then includes checkpoint saves and logging. On the demo's 16.7 minutes (docs/experiments.md,
# "Performance work") steps 10-50 took 0.169 s, the whole run 0.178 s: the first estimate alone
# decayed over 6,005 steps where 5,570 fit. A shift this early changes the rate by < 1 %.
REFINE_FRACTION = 0.1


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


class LearningRateSchedule:
    """The trainer's ``learning_rate(step)`` and, as a hook, the estimate of its length from the
    time limit. ``decay_steps``: the length when already known (a resumed run's, from its
    :class:`ScheduleFile`); ``on_decay_steps`` is told each new estimate (to keep it)."""

    def __init__(
        self,
        train: TrainSection,
        *,
        decay_steps: int | None = None,
        on_decay_steps: Callable[[int], None] | None = None,
    ):
        self.train, self.on_decay_steps = train, on_decay_steps
        estimate = decay_steps is None and train.time_limit_minutes is not None
        self._estimates_left = 2 if estimate else 0  # after TIMED_STEPS, then after REFINE_FRACTION
        self.decay_steps = train.steps if decay_steps is None else decay_steps

    def rate(self, step: int) -> float:
        return learning_rate(self.train, step, self.decay_steps)

    def __call__(self, info) -> None:
        if not self._estimates_left:
            return
        train, clock, limit = self.train, info.clock, self.train.time_limit_minutes
        now, again = clock.now(), self._estimates_left == 1
        timed = info.step - clock.compiled_step
        if again:  # the second estimate: once REFINE_FRACTION of the budget has been trained
            due = now - clock.compiled_at >= REFINE_FRACTION * 60 * limit
        else:
            due = timed >= TIMED_STEPS
        if not due:
            return
        self._estimates_left -= 1
        fit = steps_that_fit(info.step, now - clock.start, (now - clock.compiled_at) / timed, 60 * limit)
        new = min(train.steps, max(fit, min(train.warmup_steps, train.steps - 1) + 1))
        if again and new == self.decay_steps:
            return
        self.decay_steps = new
        log.info(
            "learning rate decays over %d steps (what fits in %.1f min%s)",
            new,
            limit,
            ", measured again" if again else "",
        )
        if self.on_decay_steps is not None:
            self.on_decay_steps(new)


class ScheduleFile:
    """The learning-rate schedule's length, once estimated from the time budget, stays fixed
    across resumes: kept in the run dir, forgotten by a fresh run."""

    def __init__(self, path: Path, resume: bool):
        self.path, self.decay_steps = path, None
        if resume and path.is_file():
            self.decay_steps = int(json.loads(path.read_text())["decay_steps"])
        elif not resume:
            path.unlink(missing_ok=True)

    def write(self, decay_steps: int) -> None:
        self.path.write_text(json.dumps({"decay_steps": decay_steps}))


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


# What a resumed run sets aside for its final evaluation (the one before training that timed it ran
# in the first invocation) and for each curve point
RESUMED_FINAL_EVAL_S = 120.0
RESUMED_CURVE_EVAL_S = RESUMED_FINAL_EVAL_S / 8


def within_run_budget(
    cfg: RunConfig,
    t_start: float,
    final_eval_s: float,
    curve_eval_s: float,
    start_step: int,
    num_prompts: int,
    bench_eval_s: float = 0.0,
) -> TrainSection:
    """``cfg.train`` with ``train.run_minutes`` turned into a training time limit: what is left after
    the final evaluation (``final_eval_s``, estimated from the one before training, and
    ``bench_eval_s`` for the benchmark slice of ``eval.final_bench``) and the curve points
    (``curve_eval_s`` each)."""
    train, ev = cfg.train, cfg.eval
    if train.run_minutes is None:
        return train
    elapsed = time.perf_counter() - t_start
    if start_step:
        final_eval_s = RESUMED_FINAL_EVAL_S if num_prompts else 0.0
        curve_eval_s = RESUMED_CURVE_EVAL_S if num_prompts else 0.0
        log.warning(
            "train.run_minutes on a resume: counted from this invocation's start, %.0f s set aside for "
            "the final evaluation",
            final_eval_s,
        )
    if not (num_prompts and ev.curve_every_minutes):
        curve_eval_s = 0.0
    final_eval_s += bench_eval_s
    minutes = training_minutes_in_budget(
        train.run_minutes, elapsed, final_eval_s, curve_eval_s, ev.curve_every_minutes
    )
    if minutes <= 0:
        raise ConfigError(
            f"train.run_minutes={train.run_minutes:g}: {elapsed / 60:.1f} minutes spent before training and "
            f"{final_eval_s / 60:.1f} set aside for the final evaluation leave no time to train; raise "
            "train.run_minutes (a second run reuses the prepared target, data and features)"
        )
    if train.time_limit_minutes is not None:
        minutes = min(minutes, train.time_limit_minutes)
    log.info(
        "train.run_minutes=%g: %.1f min spent, %.1f min of training (the final evaluation ~%.0f s, "
        "curve points ~%.0f s each)",
        train.run_minutes,
        elapsed / 60,
        minutes,
        final_eval_s,
        curve_eval_s,
    )
    return dataclasses.replace(train, time_limit_minutes=minutes)
