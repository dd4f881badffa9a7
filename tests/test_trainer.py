"""The Trainer and its hooks on a fake step, fake data and a fake clock (no model, no jit)."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from dflash_jax.training import hooks
from dflash_jax.training.run_config import TrainSection
from dflash_jax.training.trainer import DataStalled, StepInfo, Trainer, TrainState


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Batches:
    """The data iterator's interface: next() plus a checkpointable state; ``n`` batches."""

    def __init__(self, n: int = 10_000):
        self.i, self.n = 0, n

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i

    def get_state(self):
        return {"i": self.i}


class FakeCheckpointer:
    def __init__(self):
        self.saves, self.closed = [], False

    def save(self, step, drafter, optimizer, data_state, config, *, force=False):
        self.saves.append((step, force, data_state["shards"]["0"]["i"]))

    def check(self):
        pass

    def close(self):
        self.closed = True


def _trainer(steps=10, *, clock=None, skipped=(), on_step=None, **train_kw):
    """A Trainer whose step takes 1 s of ``clock`` and is skipped (no update) on the steps in ``skipped``."""
    clock = clock or Clock()
    train = TrainSection(steps=steps, warmup_steps=1, learning_rate=1e-3, **train_kw)

    def train_step(drafter, optimizer, target, batch, key, lr):
        clock.t += 1.0
        n = len(calls) + 1
        calls.append(batch)
        if on_step is not None:
            on_step(n)
        bad = n in skipped
        return {
            "loss": np.float32(np.nan if bad else 1.0),
            "grad_norm": np.float32(np.nan if bad else 1.0),
            "tokens": np.int32(10),
            "streak": np.float32(1.0),
            "skipped": np.int32(bad),
        }

    calls: list = []
    trainer = Trainer(
        train, train_step, target=None, put=lambda b: b, learning_rate=lambda s: 0.5, clock=clock
    )
    return trainer, train, calls


def test_a_hook_runs_every_n_steps_and_sees_the_step():
    trainer, _, _ = _trainer(steps=10)
    every_3, every_1 = [], []
    trainer.add_hook(every_3.append, every=3)
    trainer.add_hook(lambda info: every_1.append((info.step, info.trainer.state.step)))
    done = trainer.train(TrainState("drafter", "optimizer"), Batches())
    assert [i.step for i in every_3] == [3, 6, 9]
    assert every_1 == [(s, s) for s in range(1, 11)]  # the state counts the step before the hooks
    info = every_3[0]
    assert isinstance(info, StepInfo) and info.learning_rate == 0.5 and info.skipped_in_a_row == 0
    assert float(info.metrics["loss"]) == 1.0 and info.clock.elapsed() == 10.0  # the clock goes on
    assert (done.step, done.train_seconds, done.skipped_steps, done.stop_reason) == (10, 10.0, 0, None)
    with pytest.raises(ValueError, match="every must be >= 1"):
        trainer.add_hook(print, every=0)


def test_a_resumed_trainer_continues_its_step_count_and_hooks_start_and_end_in_order():
    trainer, _, calls = _trainer(steps=8)
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def start(self, trainer):
            seen.append(("start", self.name, trainer.state.step))

        def __call__(self, info):
            seen.append(("step", self.name, info.step))

        def end(self, trainer, error):
            seen.append(("end", self.name, trainer.state.step, error))

    trainer.add_hook(Recorder("a"), every=4)
    trainer.add_hook(Recorder("b"), every=4)
    done = trainer.train(TrainState(None, None, step=5, resumed=True), Batches())
    assert done.step == 8 and len(calls) == 3
    assert seen == [
        ("start", "a", 5),
        ("start", "b", 5),
        ("step", "a", 8),
        ("step", "b", 8),
        ("end", "a", 8, None),
        ("end", "b", 8, None),
    ]


def test_a_hook_that_asks_to_stop_ends_the_loop_after_that_step():
    trainer, _, calls = _trainer(steps=100)
    after = []
    trainer.add_hook(hooks.StopAt(step=4))
    trainer.add_hook(lambda info: after.append(info.step))  # the step's later hooks still run
    done = trainer.train(TrainState(None, None), Batches())
    assert done.step == 4 and len(calls) == 4 and after == [1, 2, 3, 4]
    assert done.stop_reason == "stop at step 4"


def test_sigterm_stops_after_the_current_step_with_a_final_checkpoint():
    """As a preemption: the step in which SIGTERM arrives finishes (its hooks run), a checkpoint
    of it is saved (its data position included), and the handlers from before the loop return."""
    before = signal.getsignal(signal.SIGTERM)
    trainer, train, calls = _trainer(
        steps=100, checkpoint_every=2, on_step=lambda n: n == 5 and signal.raise_signal(signal.SIGTERM)
    )
    ckpt = FakeCheckpointer()
    checkpoints = hooks.Checkpoints(ckpt, {"config": 1})
    signals = hooks.StopOnSignal()
    trainer.add_hook(signals)
    trainer.add_hook(checkpoints, every=train.checkpoint_every)
    done = trainer.train(TrainState(None, None), Batches())
    assert done.step == 5 and len(calls) == 5 and done.stop_reason == "SIGTERM"
    assert signals.signum == signal.SIGTERM
    # step 0 first (a fresh run's fallback), every 2 steps, then the step the signal stopped
    assert ckpt.saves == [(0, True, 0), (2, False, 2), (4, False, 4), (5, True, 5)] and ckpt.closed
    assert signal.getsignal(signal.SIGTERM) is before


def test_skipped_steps_save_nothing_and_too_many_in_a_row_stop_naming_the_kept_checkpoint():
    trainer, train, _ = _trainer(steps=100, checkpoint_every=2, max_nonfinite_steps=3, skipped={4, 6, 7, 8})
    ckpt = FakeCheckpointer()
    checkpoints = hooks.Checkpoints(ckpt, {})
    streaks = []
    trainer.add_hook(lambda info: streaks.append(info.skipped_in_a_row))
    trainer.add_hook(hooks.StopOnDivergence(train, checkpoints))
    trainer.add_hook(checkpoints, every=train.checkpoint_every)
    with pytest.raises(
        hooks.TrainingDiverged, match=r"3 steps in a row.*stopped at step 8.*kept checkpoint: step 2"
    ):
        trainer.train(TrainState(None, None), Batches())
    assert streaks == [0, 0, 0, 1, 0, 1, 2, 3]
    assert trainer.skipped_steps == 4
    # no save of step 4 or 6 (skipped), none at the end (the run failed); closed all the same
    assert [s for s, _, _ in ckpt.saves] == [0, 2] and ckpt.closed


def test_a_failing_end_fails_the_run_but_never_hides_the_error_that_stopped_it():
    class FailsAtEnd:
        def __call__(self, info):
            pass

        def end(self, trainer, error):
            raise OSError("end failed")

    class RecordsItsEnd:
        def __init__(self):
            self.errors = []

        def __call__(self, info):
            pass

        def end(self, trainer, error):
            self.errors.append(error)

    trainer, _, _ = _trainer(steps=3)
    later = RecordsItsEnd()
    trainer.add_hook(FailsAtEnd())
    trainer.add_hook(later)
    with pytest.raises(OSError, match="end failed"):
        trainer.train(TrainState(None, None), Batches())
    assert later.errors == [None]  # the later hook still ended

    def boom(info):
        raise RuntimeError("step hook failed")

    trainer, _, _ = _trainer(steps=3)
    later = RecordsItsEnd()
    trainer.add_hook(FailsAtEnd())
    trainer.add_hook(boom)
    trainer.add_hook(later)
    with pytest.raises(RuntimeError, match="step hook failed"):
        trainer.train(TrainState(None, None), Batches())
    assert [str(e) for e in later.errors] == ["step hook failed"]


def test_the_tau_curve_is_off_the_training_clock():
    """A curve point every 2 minutes of training that takes 100 s: the time limit (5 min) and the
    trainer's seconds count the steps only."""
    clock = Clock()
    points = []

    def measure(step):
        clock.t += 100.0
        points.append(step)

    trainer, train, calls = _trainer(steps=1000, clock=clock, time_limit_minutes=5.0)
    trainer.add_hook(hooks.TauCurve(measure, every_minutes=2.0))
    trainer.add_hook(hooks.StopAt(minutes=train.time_limit_minutes))
    done = trainer.train(TrainState(None, None), Batches())
    assert points == [120, 240]
    assert done.step == 301 and done.train_seconds == 301.0 and clock.t == 501.0
    assert done.stop_reason == "time limit"


def test_the_end_of_the_data_ends_the_loop_and_no_data_at_all_is_an_error():
    trainer, _, _ = _trainer(steps=100)
    done = trainer.train(TrainState(None, None), Batches(n=7))
    assert done.step == 7 and done.stop_reason is None
    trainer, _, _ = _trainer(steps=100)
    with pytest.raises(DataStalled, match="no batch at all"):
        trainer.train(TrainState(None, None), Batches(n=0))


def test_train_metrics_log_every_n_steps_the_last_and_every_skipped_one():
    class Logger:
        def __init__(self):
            self.rows = []

        def log(self, step, metrics):
            self.rows.append((step, metrics))

    logger = Logger()
    trainer, train, _ = _trainer(steps=9, log_every=4, skipped={6})
    metrics = hooks.TrainMetrics(train, logger, quiet=True)
    trainer.add_hook(metrics)
    trainer.train(TrainState(None, None), Batches())
    assert [s for s, _ in logger.rows] == [4, 6, 8, 9]
    step, row = logger.rows[0]
    # steps 2-4 after the compiling one: 3 steps of 10 tokens in 3 s
    assert row["tokens_per_s"] == pytest.approx(10.0) and row["step_time_s"] == pytest.approx(3 / 4)
    assert set(row) >= {"loss", "streak", "skipped", "tokens", "grad_norm"}
    assert metrics.last is logger.rows[-1][1]
