"""Runs fail fast and clearly and never keep a bad state (issue 16): one test per item.

1. non-finite steps apply no update; the run stops after N in a row with a finite checkpoint
2. no hangs: data that yields nothing fails naming the filter
3. output dirs never mix runs; cached artefacts are keyed by their shape; --resume checks the config
4. one error path (``error: ...``, exit 2); the whole config is validated before any model is built
5. the output dir is checked writable; a failed checkpoint save fails the run at that save
6. metrics truncated on resume; SIGTERM exits 143; a skip-fraction limit; exports refuse bad --out
"""

from __future__ import annotations

import json
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from dflash_jax.data import pipeline, sources
from dflash_jax.data.pipeline import DataConfig, make_train_iterator

# ------------------------------------------------------------------------------------ helpers


def _chat(i: int, words: int = 12) -> dict:
    text = " ".join(["word"] * words)
    return {
        "id": f"c{i}",
        "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": text}],
    }


@pytest.fixture(scope="module")
def tokenizer():
    from convert.smollm2 import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    sources.write_chat_jsonl(path, [_chat(i) for i in range(12)])
    return str(path)


def _data_cfg(path, **kw):
    base = dict(sources=[path], max_length=64, batch_size=2, num_epochs=None, prefetch=0)
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def tiny_models():
    """A tiny random Qwen3-style target and a one-layer drafter (no files, no torch)."""
    from fixtures import tiny_target_config

    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.drafter.config import DrafterConfig
    from dflash_jax.layers import RopeConfig
    from dflash_jax.target.model import TargetModel

    tc = tiny_target_config(
        num_layers=4, rope=RopeConfig(theta=1e6), tie_word_embeddings=True, max_position_embeddings=512
    )
    target = TargetModel(tc, rngs=nnx.Rngs(0))
    dcfg = DrafterConfig.for_target(tc, num_layers=1, mask_token_id=255, block_size=4)
    return target, dcfg, init_drafter(dcfg, target, 0)


def _batch(T=32, rows=2, seed=0):
    rng = np.random.default_rng(seed)
    loss_mask = np.zeros((rows, T), np.int32)
    loss_mask[:, 8:] = 1
    return {
        "input_ids": jnp.asarray(rng.integers(0, 250, (rows, T)), jnp.int32),
        "positions": jnp.asarray(np.tile(np.arange(T), (rows, 1)), jnp.int32),
        "segment_ids": jnp.ones((rows, T), jnp.int32),
        "loss_mask": jnp.asarray(loss_mask),
    }


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------- 1. non-finite updates


def test_nonfinite_step_applies_no_update(tiny_models):
    """A step whose loss/gradients are NaN leaves params and optimizer state (count included)
    exactly as they were and reports skipped=1; a finite step then updates as usual."""
    from dflash_jax.training.run_config import TrainSection
    from dflash_jax.training.step import make_train_step

    target, _, drafter = tiny_models
    drafter = nnx.clone(drafter)
    optimizer = nnx.Optimizer(drafter, optax_adam(), wrt=nnx.Param)
    step = make_train_step(TrainSection(max_anchors=4, loss_chunk=64))
    poisoned = nnx.clone(target)
    poisoned.embed_tokens[...] = poisoned.embed_tokens[...] * jnp.nan  # NaN lm_head -> NaN loss
    before_p = _leaves(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    before_o = _leaves(nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState)))
    m = step(drafter, optimizer, poisoned, _batch(), jax.random.key(0), np.float32(1e-2))
    assert not np.isfinite(float(m["loss"])) and int(m["skipped"]) == 1
    after_p = _leaves(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    after_o = _leaves(nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState)))
    for a, b in zip(before_p + before_o, after_p + after_o, strict=True):
        np.testing.assert_array_equal(a, b)
    m = step(drafter, optimizer, target, _batch(), jax.random.key(0), np.float32(1e-2))
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0
    assert int(optimizer.step[...]) == 1
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(before_p, _leaves(nnx.to_pure_dict(nnx.state(drafter, nnx.Param))), strict=True)
    ]
    assert any(changed)


def optax_adam():
    import optax

    return optax.adam(1e-2)


# --------------------------------------------------------------------------- 2. no hangs


def _error_of_next(it, seconds: float) -> BaseException:
    """The exception ``next(it)`` raises within ``seconds`` (a daemon thread: a hang fails the test)."""
    out: list = []

    def pull():
        try:
            out.append(next(it))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"no batch and no error after {seconds} s: the pipeline hangs")
    assert isinstance(out[0], BaseException), "a batch came out of data that has no trainable document"
    return out[0]


def test_no_trainable_document_fails_naming_the_filter(tokenizer, chats):
    """max_length=2 drops every document; with num_epochs=None this used to spin forever."""
    err = _error_of_next(make_train_iterator(_data_cfg(chats, max_length=2), tokenizer), 60)
    assert isinstance(err, ValueError) and re.search(r"length filter.*data.max_length=2", str(err)), err
    big = _data_cfg(chats, min_loss_tokens=1000, max_length=2048)
    err = _error_of_next(make_train_iterator(big, tokenizer), 60)
    assert isinstance(err, ValueError) and re.search(r"loss-mask filter.*min_loss_tokens=1000", str(err)), err


# ------------------------------------------------------------- 6c. skipped-records limit


def test_skip_fraction_above_the_limit_fails_naming_the_reasons(tmp_path, chats):
    """A Latin-1 file whose records are mostly undecodable fails the load instead of training on
    the few that survive; the error names the reason, where it was first seen, and the key."""
    good = [json.dumps(_chat(i)) for i in range(3)]
    bad = [json.dumps(_chat(10 + i), ensure_ascii=False).replace("question", "quéstion") for i in range(7)]
    path = tmp_path / "latin1.jsonl"
    path.write_bytes("\n".join(good + bad).encode("latin-1") + b"\n")
    cfg = _data_cfg(str(path))
    with pytest.raises(
        ValueError,
        match=rf"skipped 7 of 10 .*data.max_skip_fraction=0.1: malformed_json: 7 \(first at {path}:4\)",
    ):
        pipeline.load_index(cfg)
    index, report = pipeline.load_index(_data_cfg(str(path), max_skip_fraction=0.8))
    assert len(index) == 3 and report.num_skipped == 7


# ------------------------------------------------------------------------ CLI-level helpers


def _tiny_args(run_dir, *overrides) -> list[str]:
    """The tiny config, shrunk to seconds per run: few short records, short rows, no evaluation.
    Flags among ``overrides`` (``--resume``) go first, as argparse wants them."""
    flags = [o for o in overrides if o.startswith("--")]
    overrides = tuple(o for o in overrides if not o.startswith("--"))
    return [
        "--config",
        "tiny",
        "--quiet",
        *flags,
        f"output_dir={run_dir}",
        "data.max_records=40",
        "data.heldout_count=0",
        "data.max_length=64",
        "data.batch_size=2",
        "mesh.num_devices=1",
        "train.max_anchors=8",
        "train.log_every=1",
        "train.warmup_steps=1",
        *overrides,
    ]


def _main(argv, capsys):
    """Run ``python -m dflash_jax.train`` in-process: (exit code, stderr lines without log lines)."""
    from dflash_jax.train import main

    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    return rc, lines


def _train_rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def _finite_params(run_dir, step=None) -> int:
    """Read a run's checkpoint params; assert every one finite; return the checkpoint's step."""
    from dflash_jax.checkpoint import read_checkpoint, resolve_checkpoint

    _, got = resolve_checkpoint(run_dir, step)
    _, params, _ = read_checkpoint(run_dir, got)
    leaves = jax.tree.leaves(params)
    assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)
    return got


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One finished 4-step tiny run (checkpoints at steps 0, 2 and 4), shared read-only."""
    from dflash_jax.train import main

    run_dir = tmp_path_factory.mktemp("tiny_run")
    assert main(_tiny_args(run_dir, "train.steps=4", "train.checkpoint_every=2")) == 0
    return run_dir


def test_diverging_run_stops_with_a_finite_checkpoint_that_resumes(tmp_path, capsys):
    """lr=1e6: steps stop applying updates, the run stops after max_nonfinite_steps in a row naming
    the step and the checkpoint it keeps; that checkpoint is finite and resumes at a sane lr."""
    run_dir = tmp_path / "run"
    # the blown-up-update check off (issue 26 has its own test): this one is about NaN/inf steps
    argv = _tiny_args(
        run_dir,
        "train.learning_rate=1e6",
        "train.steps=12",
        "train.max_nonfinite_steps=2",
        "train.max_update_ratio=1e30",
    )
    rc, errors = _main(argv, capsys)
    assert rc == 2 and len(errors) == 1, errors
    assert re.search(
        r"error: 2 steps in a row skipped.*not finite.*stopped at step \d+.*kept checkpoint: step 0",
        errors[0],
    ), errors[0]
    rows = _train_rows(run_dir)
    assert rows[-1]["skipped"] == 1 and rows[-2]["skipped"] == 1
    assert _finite_params(run_dir) == 0
    rc, errors = _main(_tiny_args(run_dir, "--resume", "train.learning_rate=1e-3", "train.steps=3"), capsys)
    assert rc == 0 and not errors
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and r["skipped"] == 0 for r in rows)
    assert _finite_params(run_dir) == 3


# --------------------------------------------------------------------------- 2. no hangs (run)


def test_run_with_max_length_2_fails_naming_the_length_filter(tmp_path, capsys):
    rc, errors = _main(_tiny_args(tmp_path / "run", "data.max_length=2", "train.max_anchors=1"), capsys)
    assert rc == 2 and len(errors) == 1 and "length filter" in errors[0], errors


def test_sigterm_while_waiting_for_data_exits_143_after_its_checkpoint(tmp_path, capsys, monkeypatch):
    """The data stalls after two batches; SIGTERM is honoured while waiting: a checkpoint of step 2
    is written and the run exits 143 (128 + SIGTERM) within seconds."""
    import os
    import signal

    from dflash_jax.data import shards

    real = shards.ShardedBatchIterator
    stalled = threading.Event()

    class Stalling:
        def __init__(self, it):
            self.it, self.n = it, 0

        def __iter__(self):
            return self

        def __next__(self):
            self.n += 1
            if self.n > 2:
                stalled.set()
                threading.Event().wait()  # never returns
            return next(self.it)

        def __getattr__(self, name):
            return getattr(self.it, name)

    monkeypatch.setattr(shards, "ShardedBatchIterator", lambda *a, **k: Stalling(real(*a, **k)))

    def kill_when_stalled():
        stalled.wait(600)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=kill_when_stalled, daemon=True).start()
    rc, errors = _main(_tiny_args(tmp_path / "run", "train.steps=50"), capsys)
    assert rc == 143, errors
    assert _finite_params(tmp_path / "run") == 2


# ------------------------------------------------------------------------------ 3. output dirs


def test_fresh_run_into_a_used_dir_is_refused_unless_overwrite(tmp_path, capsys):
    from dflash_jax.training import run_dir as rd

    used = tmp_path / "used"
    (used / "checkpoints" / "7").mkdir(parents=True)
    (used / "metrics.jsonl").write_text('{"step": 7, "split": "train", "loss": 1.0}\n')
    (used / "notes.txt").write_text("mine")
    rc, errors = _main(_tiny_args(used), capsys)
    assert rc == 2 and len(errors) == 1 and "already holds a run" in errors[0] and "--overwrite" in errors[0]
    assert (used / "checkpoints" / "7").is_dir()  # nothing touched
    rd.prepare(used, resume=False, overwrite=True)
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]  # the old run is gone, not mixed


def test_resume_auto_starts_a_fresh_dir_then_resumes_it(tmp_path, capsys):
    """``--resume auto`` twice, as a scheduler requeues one command: the first run starts (replacing
    what an attempt that never checkpointed left), the second continues from its checkpoint."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 999.0}\n')
    rc, errors = _main(
        [*_tiny_args(run_dir, "train.steps=2", "train.checkpoint_every=2"), "--resume", "auto"], capsys
    )
    assert rc == 0, errors
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2] and _train_rows(run_dir)[0]["loss"] != 999.0
    rc, errors = _main(
        _tiny_args(run_dir, "--resume=auto", "train.steps=4", "train.checkpoint_every=2"), capsys
    )
    assert rc == 0, errors
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2, 3, 4]  # steps 1-2 not trained again
    rc, errors = _main(_tiny_args(run_dir, "--resume=auto", "--overwrite"), capsys)
    assert rc == 2 and "contradict" in errors[0]


def test_resume_flag_never_swallows_the_override_after_it():
    from dflash_jax.train import _resume_value_attached

    assert _resume_value_attached(["--resume", "train.steps=5"]) == ["--resume=latest", "train.steps=5"]
    assert _resume_value_attached(["--resume", "auto", "x=1"]) == ["--resume=auto", "x=1"]
    assert _resume_value_attached(["a=1", "--resume"]) == ["a=1", "--resume=latest"]


def test_tiny_target_cache_is_keyed_by_its_shape(tmp_path):
    """A cached tiny target of another size is never reused (it was: hidden 64 in a hidden-32 run)."""
    from convert.tiny_target import make_tiny_target_dir
    from dflash_jax.training.run_config import load_run_config

    dirs = {}
    for h in (32, 64, 32):
        section = load_run_config("tiny", [f"target.tiny_hidden_size={h}"]).target
        d = make_tiny_target_dir(section, 300, tmp_path)
        assert json.loads((d / "config.json").read_text())["hidden_size"] == h
        dirs.setdefault(h, d)
        assert d == dirs[h]
    assert dirs[32] != dirs[64]


def test_resume_refuses_shape_or_data_changes_naming_the_keys(tiny_run, capsys):
    argv = _tiny_args(tiny_run, "--resume", "drafter.block_size=8", "data.max_length=32", "train.steps=6")
    rc, errors = _main(argv, capsys)
    assert rc == 2 and len(errors) == 1, errors
    assert "drafter.block_size: 4 -> 8" in errors[0] and "data.max_length: 64 -> 32" in errors[0]
    assert "train.steps" not in errors[0].split("Only these")[0]  # a safe change is not named


# -------------------------------------------------------------------------- 4. one error path


@pytest.mark.parametrize(
    "override, named",
    [
        ("drafter.block_size=0", "drafter.block_size"),
        ("drafter.num_layers=0", "drafter.num_layers"),
        ("train.max_anchors=100000", "train.max_anchors"),
        ("data.sources=[/nonexistent/chats.jsonl]", "/nonexistent/chats.jsonl"),
        ("output_dir=/proc/dflash-test-run", "/proc/dflash-test-run"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2_before_any_model(
    override, named, tmp_path, capsys, monkeypatch
):
    """Config, data and I/O errors: one ``error:`` line naming the thing, exit 2, and no model is
    built first (the target loader is never called)."""
    import convert.tiny_target as tiny_target

    def no_model(*a, **k):
        raise AssertionError("a model was built before the config was fully checked")

    monkeypatch.setattr(tiny_target, "make_tiny_target_dir", no_model)
    monkeypatch.setattr("dflash_jax.load_target", no_model)
    rc, errors = _main(_tiny_args(tmp_path / "run", override), capsys)
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("error: ") and named in errors[0], errors


def test_numbers_like_6e_4_parse_and_anchor_bounds_are_checked_up_front():
    from dflash_jax.config_io import ConfigError
    from dflash_jax.training.run_config import load_run_config

    assert load_run_config("tiny", ["train.learning_rate=6e-4"]).train.learning_rate == pytest.approx(6e-4)
    assert load_run_config("tiny", ["train.learning_rate=1e6"]).train.learning_rate == 1e6
    with pytest.raises(ConfigError, match=r"train.max_anchors=100000 .*data.max_length=128"):
        load_run_config("tiny", ["train.max_anchors=100000"])


def test_truncated_target_weights_are_one_error_line(tmp_path, capsys):
    from convert.tiny_target import make_tiny_target_dir
    from dflash_jax.training.run_config import load_run_config

    section = load_run_config("tiny", ["target.tiny_hidden_size=32"]).target
    target = make_tiny_target_dir(section, 49152, tmp_path / "t")
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    rc, errors = _main(
        _tiny_args(tmp_path / "run", f"target.path={target}", "target.tokenizer=smollm2"), capsys
    )
    assert rc == 2 and len(errors) == 1 and "model.safetensors" in errors[0], errors


def test_every_cli_reports_expected_errors_the_same_way(tmp_path, capsys):
    from convert import drafter_to_hf, hf_to_drafter
    from dflash_jax import eval as eval_cli
    from dflash_jax import regenerate

    missing = str(tmp_path / "missing")
    cases = [
        (drafter_to_hf.main, ["--checkpoint", missing, "--out", str(tmp_path / "o1")]),
        (hf_to_drafter.main, ["--hf", missing, "--out", str(tmp_path / "o2")]),
        (
            eval_cli.main,
            [
                "--config",
                "tiny",
                f"target.path={missing}",
                f"eval.drafter={missing}",
                f"eval.prompts={missing}",
            ],
        ),
        (
            regenerate.main,
            [
                "--config",
                "tiny",
                f"target.path={missing}",
                f"data.sources={missing}",
                "--out",
                str(tmp_path / "o3.jsonl"),
            ],
        ),
    ]
    for fn, argv in cases:
        rc = fn(argv)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (fn.__module__, err[-2000:])


# ------------------------------------------------------------------------ 5. checkpoint writes


def test_failed_checkpoint_save_fails_at_that_save(tiny_models, tmp_path):
    """The checkpoint dir vanishes under a running job: the very next save raises naming its
    step (it used to be noticed two saves later, then wait minutes on an orbax timeout)."""
    import optax

    from dflash_jax.checkpoint import Checkpointer

    _, _, drafter = tiny_models
    opt = nnx.Optimizer(drafter, optax.adam(1e-3), wrt=nnx.Param)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    ckpt.save(1, drafter, opt, None, {"step": 1})
    ckpt.manager.wait_until_finished()
    import shutil

    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "checkpoints").write_text("not a directory")
    t0 = time.perf_counter()
    with pytest.raises(OSError, match=r"checkpoint of step 2"):
        ckpt.save(2, drafter, opt, None, {"step": 2})
    assert time.perf_counter() - t0 < 60
    ckpt.close()


def test_nonfinite_params_are_never_checkpointed(tiny_models, tmp_path):
    import optax

    from dflash_jax.checkpoint import Checkpointer

    _, _, drafter = tiny_models
    bad = nnx.clone(drafter)
    bad.fc[...] = bad.fc[...].at[0, 0].set(jnp.nan)
    opt = nnx.Optimizer(bad, optax.adam(1e-3), wrt=nnx.Param)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    with pytest.raises(FloatingPointError, match=r"fc"):
        ckpt.save(1, bad, opt, None, {"step": 1})
    ckpt.close()
    assert not any((tmp_path / "checkpoints").glob("1*"))


# --------------------------------------------------------------- 6. metrics, exit codes, exports


def test_metrics_are_truncated_to_the_resumed_step(tiny_run, tmp_path, capsys):
    """A run killed after logging steps its last checkpoint does not hold: the resumed run logs
    those steps again, so each step must appear once."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:  # what a kill -9 after steps 5 and 6 leaves
        for s in (5, 6):
            f.write(json.dumps({"step": s, "split": "train", "loss": 999.0, "streak": 1.0}) + "\n")
    rc, errors = _main(_tiny_args(run_dir, "--resume", "train.steps=5", "train.checkpoint_every=2"), capsys)
    assert rc == 0, errors
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["loss"] != 999.0


def test_export_refuses_a_used_out_dir_and_nonfinite_params(tiny_run, tmp_path, capsys, monkeypatch):
    from convert import drafter_to_hf

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc = drafter_to_hf.main(["--checkpoint", str(tiny_run), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "--overwrite" in err and (out / "keep.txt").is_file()
    assert drafter_to_hf.main(["--checkpoint", str(tiny_run), "--out", str(out), "--overwrite"]) == 0
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()

    import dflash_jax.checkpoint as ck

    real = ck.read_checkpoint

    def nan_params(*a, **k):  # a checkpoint written before checkpoints were checked for NaN
        cfg, params, run_cfg = real(*a, **k)
        return cfg, jax.tree.map(lambda x: np.full_like(x, np.nan), params), run_cfg

    monkeypatch.setattr(ck, "read_checkpoint", nan_params)
    monkeypatch.setattr(drafter_to_hf, "read_checkpoint", nan_params, raising=False)
    rc = drafter_to_hf.main(["--checkpoint", str(tiny_run), "--out", str(tmp_path / "nan")])
    err = capsys.readouterr().err
    assert rc == 2 and "not finite" in err and not (tmp_path / "nan" / "model.safetensors").exists()


# ==================================================================================================
# Issue 26: nothing a user made is lost, and every failure is one line naming its cause.
# ==================================================================================================


def _tiny_target_with_tokenizer(directory):
    """The tiny random target (hidden 32) with SmolLM2's tokenizer files beside its weights."""
    import shutil

    from convert.smollm2 import smollm2_dir
    from convert.tiny_target import make_tiny_target_dir
    from dflash_jax.training.run_config import load_run_config

    section = load_run_config("tiny", ["target.tiny_hidden_size=32", "target.tiny_num_layers=2"]).target
    target = make_tiny_target_dir(section, 49152, directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir() / name).is_file():
            shutil.copy(smollm2_dir() / name, target / name)
    return target


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    return [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]


def test_26_1_regenerate_never_replaces_a_file_and_fails_when_it_writes_nothing(tmp_path, chats, capsys):
    """An existing --out is refused (exit 2, bytes unchanged) before the target loads; a run that
    regenerates nothing exits 2 saying why and creates no file; --overwrite replaces."""
    from dflash_jax import regenerate

    target = _tiny_target_with_tokenizer(tmp_path / "target")
    base = [
        "--config",
        "tiny",
        f"target.path={target}",
        "target.tokenizer=null",  # the target dir's own tokenizer
        f"data.sources={chats}",
        "regen.num_prompts=2",
        "regen.max_new_tokens=2",
    ]
    out = tmp_path / "regen.jsonl"
    out.write_bytes(b"hours of GPU time\n")
    assert regenerate.main([*base, "--out", str(out)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and str(out) in errors[0] and "--overwrite" in errors[0], errors
    assert out.read_bytes() == b"hours of GPU time\n"

    empty = tmp_path / "empty.jsonl"
    assert regenerate.main([*base, "--out", str(empty), "regen.max_prompt_tokens=1"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "nothing to write" in errors[0] and "over the length limit" in errors[0]
    assert not empty.exists()

    # the other commands' outputs: refused the same way, before anything loads
    from dflash_jax import eval as eval_cli
    from dflash_jax.tools import mesh_experiment

    report = tmp_path / "eval.json"
    report.write_text("{}")
    (tmp_path / "mesh").mkdir()
    (tmp_path / "mesh" / "layouts.csv").write_text("mine")
    missing = str(tmp_path / "missing")
    for fn, argv, flag in [
        (
            eval_cli.main,
            ["--config", "tiny", f"eval.drafter={missing}", f"eval.prompts={missing}", "--json", str(report)],
            "--json",
        ),
        (
            mesh_experiment.main,
            ["--config", "tiny", "--layouts", "data=1", "--out", str(tmp_path / "mesh")],
            "--out",
        ),
    ]:
        assert fn(argv) == 2
        errors = _errors(capsys)
        assert len(errors) == 1 and f"{flag} " in errors[0] and "--overwrite" in errors[0], errors
    assert report.read_text() == "{}" and (tmp_path / "mesh" / "layouts.csv").read_text() == "mine"

    # the random target's greedy answer is blank
    sampled = ["regen.temperature=1.0", "regen.max_new_tokens=8"]
    assert regenerate.main([*base, *sampled, "--out", str(out), "--overwrite"]) == 0
    assert out.read_bytes() != b"hours of GPU time\n" and sources.read_chat_jsonl(out)


def test_26_2_blown_up_update_is_never_kept_and_resume_step_names_a_checkpoint(tmp_path, capsys):
    """lr=1e30: the first real update is finite (~1e30) but blown up; it is refused like a NaN one,
    so the checkpoint the error names holds sane parameters and resumes at a sane rate, named by
    --resume-step; the checkpoints after it are moved aside, not deleted."""
    from dflash_jax.checkpoint import read_checkpoint

    run_dir = tmp_path / "run"
    argv = _tiny_args(
        run_dir,
        "train.learning_rate=1e30",
        "train.steps=12",
        "train.checkpoint_every=1",
        "train.max_nonfinite_steps=2",
    )
    rc, errors = _main(argv, capsys)
    assert rc == 2 and len(errors) == 1, errors
    m = re.search(r"blown-up update.*kept checkpoint: step (\d+).*--resume-step (\d+)", errors[0])
    assert m and m.group(1) == m.group(2), errors[0]
    kept = int(m.group(1))
    _, params, _ = read_checkpoint(run_dir, kept)
    assert max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(params)) < 1e3
    # an older checkpoint than the latest, to see --resume-step pick it and set the others aside
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    pick = steps[0]
    rc, errors = _main(
        _tiny_args(run_dir, f"--resume-step={pick}", "train.learning_rate=1e-3", f"train.steps={pick + 2}"),
        capsys,
    )
    assert rc == 0 and not errors, errors
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, pick + 3))
    assert all(r["skipped"] == 0 and np.isfinite(r["loss"]) and r["update_ratio"] < 1 for r in rows[pick:])
    aside = sorted(int(p.name) for p in (run_dir / f"checkpoints.after-step-{pick}").iterdir())
    assert aside == [s for s in steps if s > pick]


def test_26_2_float16_export_of_an_overflowing_drafter_is_refused_naming_the_tensor(
    tiny_run, tmp_path, capsys, monkeypatch
):
    """Finite float32 weights beyond float16's range become inf in the cast: checked after it."""
    import dflash_jax.checkpoint as ck
    from convert import drafter_to_hf

    real = ck.read_checkpoint

    def huge(*a, **k):
        cfg, params, run_cfg = real(*a, **k)
        return cfg, jax.tree.map(lambda x: np.asarray(x) * 1e6, params), run_cfg

    monkeypatch.setattr(drafter_to_hf, "read_checkpoint", huge)
    out = tmp_path / "f16"
    assert drafter_to_hf.main(["--checkpoint", str(tiny_run), "--out", str(out), "--dtype", "float16"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "float16" in errors[0] and re.search(r"\.weight", errors[0]), errors
    assert not out.exists()


def test_26_3_duplicate_yaml_keys_are_an_error_naming_the_key_and_line(tmp_path):
    from dflash_jax.config_io import ConfigError
    from dflash_jax.training.run_config import load_run_config

    path = tmp_path / "dup.yaml"
    path.write_text(
        "target:\n  path: tiny\ntrain:\n  learning_rate: 1.0e-3\ndata:\n  batch_size: 2\ntrain:\n  steps: 5\n"
    )
    with pytest.raises(ConfigError, match=r"duplicate key 'train' \(first given on line 3\) at line 7"):
        load_run_config(str(path))
    with pytest.raises(ConfigError, match=r"duplicate key 'x'"):
        load_run_config("tiny", ["target.architecture={x: 1, x: 2}"])


def test_26_4_integer_target_weights_are_refused_naming_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    import dflash_jax

    target = _tiny_target_with_tokenizer(tmp_path / "target")
    tensors = load_file(target / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].astype(np.int32)
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}' is stored as int32"):
        dflash_jax.load_target(target)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ("mesh.num_devices=8", "mesh.data=8", "data.batch_size=4"),
            r"data.batch_size=4 .*data x fsdp = 8 x 1",
        ),
        (
            ("mesh.num_devices=8", "mesh.data=4", "mesh.fsdp=2", "data.batch_size=2"),
            r"data.batch_size=2 .*4 x 2",
        ),
        (("data.batch_size=4", "train.micro_batches=3"), r"train.micro_batches=3 does not divide"),
    ],
)
def test_26_5_batch_layout_is_checked_before_anything_is_written(
    overrides, named, tmp_path, capsys, monkeypatch
):
    """It failed at the first step after the step-0 checkpoint, so the corrected rerun was refused."""
    import convert.tiny_target as tiny_target

    def no_model(*a, **k):
        raise AssertionError("a model was built before the layout was checked")

    monkeypatch.setattr(tiny_target, "make_tiny_target_dir", no_model)
    monkeypatch.setattr("dflash_jax.load_target", no_model)
    rc, errors = _main(_tiny_args(tmp_path / "run", *overrides), capsys)
    assert rc == 2 and len(errors) == 1 and re.search(named, errors[0]), errors
    assert not (tmp_path / "run").exists()


def test_26_8_nonfinite_values_are_refused_in_configs_and_drafters(tiny_run, monkeypatch):
    """lr=nan passed every `<= 0` bound; eval scored a NaN drafter tau 1.0 (import refused one)."""
    import dflash_jax.checkpoint as ck
    from convert import drafter_reader
    from dflash_jax.config_io import ConfigError
    from dflash_jax.loading import load_drafter
    from dflash_jax.training.run_config import load_run_config

    for value in ("nan", "inf", ".inf"):
        with pytest.raises(ConfigError, match=r"train.learning_rate: expected a finite number"):
            load_run_config("tiny", [f"train.learning_rate={value}"])
    real = ck.read_checkpoint

    def nan_params(*a, **k):
        cfg, params, run_cfg = real(*a, **k)
        return cfg, jax.tree.map(lambda x: np.full_like(x, np.nan), params), run_cfg

    monkeypatch.setattr(drafter_reader, "read_checkpoint", nan_params)
    with pytest.raises(FloatingPointError, match=r"parameters not finite"):
        load_drafter(tiny_run, None)


def test_26_9_errors_name_the_key_and_every_cli_takes_the_one_error_path(tmp_path, capsys, monkeypatch):
    import convert.tiny_target as tiny_target
    from dflash_jax.tools import mesh_experiment

    def no_model(*a, **k):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(tiny_target, "make_tiny_target_dir", no_model)
    monkeypatch.setattr("dflash_jax.load_target", no_model)
    (tmp_path / "a_dir").mkdir()
    cases = [
        (("target.tokenizer=/nonexistent",), r"target.tokenizer=/nonexistent: no such directory"),
        ((f"data.sources=[{tmp_path / 'a_dir'}]",), r"is a directory"),
        (("data.shards=3",), r"data.shards=3"),
    ]
    for overrides, named in cases:
        rc, errors = _main(_tiny_args(tmp_path / "run", *overrides), capsys)
        assert rc == 2 and len(errors) == 1 and re.search(named, errors[0]), (overrides, errors)
    # overrides after a flag (they were argparse errors after --resume)
    rc, errors = _main(
        ["--config", "tiny", f"output_dir={tmp_path / 'run'}", "--quiet", "data.shards=3"], capsys
    )
    assert rc == 2 and len(errors) == 1 and "data.shards=3" in errors[0], errors
    for argv in (
        ["--config", "tiny", "--layouts", "tensor=x"],
        ["--config", "tiny", "--layouts", "data=1", "target.path=/nonexistent"],
    ):
        rc = mesh_experiment.main([*argv, "--out", str(tmp_path / "mesh")])
        errors = _errors(capsys)
        assert rc == 2 and len(errors) == 1 and errors[0].startswith("error: "), (argv, errors)


def test_26_7_orbax_logs_stay_out_of_the_terminal_and_go_to_the_run_dir(tmp_path, capsys):
    """At the default verbosity orbax's INFO lines, and its worker threads' tracebacks (hundreds of
    lines around the one error line on a full disk), reached stderr; they go to orbax.log."""
    import logging

    from dflash_jax.train import main

    run_dir = tmp_path / "run"
    argv = [a for a in _tiny_args(run_dir, "train.steps=1") if a != "--quiet"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    leaked = [ln for ln in err.splitlines() if "absl" in ln or "orbax.checkpoint" in ln]
    assert not leaked, leaked[:3]
    assert "absl" in (run_dir / "orbax.log").read_text()
    try:  # what orbax's save threads log when a write fails
        raise ValueError("RESOURCE_EXHAUSTED: Error writing ...")
    except ValueError:
        logging.getLogger("absl").exception("_SignalingThread.run() raised an exception")
    assert capsys.readouterr().err == ""
    assert "RESOURCE_EXHAUSTED" in (run_dir / "orbax.log").read_text()
