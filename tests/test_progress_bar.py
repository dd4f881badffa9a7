"""The training progress bar's total (hence its ETA) follows the time limit when one is set."""

from __future__ import annotations

import dataclasses
import time

from tqdm import tqdm

from dflash_jax.training.hooks import _follow_time_limit
from dflash_jax.training.run_config import load_run_config


def test_bar_total_is_the_step_the_time_limit_stops_at():
    train = dataclasses.replace(load_run_config("tiny", []).train, steps=400, time_limit_minutes=1.0)
    now = time.perf_counter()
    bar = tqdm(total=train.steps, disable=True)
    # Started 30 s ago, first (compiling) step ended 20 s ago, 10 steps since: 2 s per step,
    # 30 s left -> 15 more steps after step 11.
    _follow_time_limit(bar, train, step=11, start_step=0, t_train=now - 30, compiled_at=now - 20, now=now)
    assert bar.total == 26  # the clock is given: exactly 11 + ceil(30 s / 2 s per step)
    # Fast steps never push the total past train.steps.
    _follow_time_limit(bar, train, step=11, start_step=0, t_train=now - 1, compiled_at=now - 0.5, now=now)
    assert bar.total == 400
