"""A run directory holds one run: checked before any model is built, never mixed with another.

* a fresh run into a directory that already holds a run (checkpoints, metrics) is refused unless
  ``--overwrite``, which removes the old run's files first;
* ``--resume auto`` (what a scheduler that requeues a job blindly passes) resumes when the
  directory holds a checkpoint and starts afresh otherwise, replacing what an attempt that never
  reached its first checkpoint left there;
* the directory must be writable (checked with a probe file at start, not at the first save);
* ``--resume`` compares the config stored with the checkpoint against the requested one and
  refuses changes that alter parameter shapes or the data stream, naming every such key; only
  keys in :data:`SAFE_ON_RESUME` (step count, schedule, logging, checkpointing, time limit,
  evaluation, layout) may change.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import uuid
from pathlib import Path

from dflash_jax.config_io import ConfigError
from dflash_jax.nested import flatten

# Files a run writes into its directory (removed by --overwrite). Cached artefacts live elsewhere.
RUN_FILES = (
    "checkpoints",
    "checkpoints.after-step-*",
    "best",
    "metrics.jsonl",
    "orbax.log",
    "metrics.png",
    "tensorboard",
    "tracking.json",
    "mlruns",
    "wandb",
    "config.json",
    "eval_*.json",
)

# Dotted config keys that may differ between a checkpoint and the run resuming it (fnmatch).
SAFE_ON_RESUME = (
    "name",
    "output_dir",
    "train.steps",
    "train.learning_rate",
    "train.warmup_steps",
    "train.end_lr_ratio",
    "train.weight_decay",
    "train.b1",
    "train.b2",
    "train.grad_clip",
    "train.loss_chunk",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.time_limit_minutes",
    "train.run_minutes",
    "train.max_nonfinite_steps",
    "train.max_update_ratio",
    "train.anchor_chunks",  # the same update in less memory, like the mesh
    "train.report_to",
    "eval.*",
    "mesh.*",
    "drafter.attention_impl",
    "target.attention_impl",
    "drafter.anchor_chunk",
    "drafter.init_from",
    "data.num_workers",
    "data.read_threads",
    "data.prefetch",
    "data.max_wait_s",
    "data.max_skip_fraction",
)


def existing_run_files(run_dir: Path) -> list[str]:
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if any(fnmatch.fnmatch(p.name, g) for g in RUN_FILES))


def prepare(run_dir: str | Path, *, resume: bool, overwrite: bool) -> Path:
    """Create/check the run directory before any model is built; returns it resolved.

    Raises :class:`ConfigError` for a fresh run into a used directory (without ``overwrite``),
    ``--resume`` without a checkpoint, or ``--resume`` with ``--overwrite``; ``OSError`` naming
    the directory when it cannot be written."""
    run_dir = Path(run_dir).expanduser().resolve()
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: pick one")
    used = existing_run_files(run_dir)
    if resume:
        if not _has_checkpoint(run_dir / "checkpoints"):
            raise ConfigError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
    elif used:
        if not overwrite:
            raise ConfigError(
                f"output_dir {run_dir} already holds a run ({', '.join(used)}); "
                "pass --resume to continue it, --overwrite to replace it, or choose another output_dir"
            )
        for name in used:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    check_writable(run_dir)
    return run_dir


def resume_auto(run_dir: str | Path, *, overwrite: bool) -> tuple[bool, bool]:
    """``--resume auto``: -> (resume, overwrite) for :func:`prepare`: resume when ``run_dir`` holds
    a checkpoint; else a fresh run that replaces an earlier attempt's files (which hold no
    checkpoint: nothing a resume could continue)."""
    if overwrite:
        raise ConfigError("--resume auto and --overwrite contradict each other: pick one")
    run_dir = Path(run_dir).expanduser().resolve()
    if _has_checkpoint(run_dir / "checkpoints"):
        return True, False
    return False, True


def set_aside_checkpoints(run_dir: Path, step: int) -> list[int]:
    """Resuming from ``step`` (``--resume-step``): move the checkpoints after it into
    ``checkpoints.after-step-<step>/`` (nothing is deleted; orbax would otherwise keep resuming,
    or refuse to save, past them). Raises ConfigError naming the steps there when ``step`` has
    no checkpoint; returns the steps moved."""
    ckpt_dir = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if step not in steps:
        raise ConfigError(
            f"--resume-step {step}: no checkpoint of step {step} in {ckpt_dir}; steps there: {steps}"
        )
    later = [s for s in steps if s > step]
    if later:
        aside = run_dir / f"checkpoints.after-step-{step}"
        n = 1
        while aside.exists():
            n += 1
            aside = run_dir / f"checkpoints.after-step-{step}.{n}"
        aside.mkdir()
        for s in later:
            (ckpt_dir / str(s)).rename(aside / str(s))
    return later


def check_writable(directory: Path) -> None:
    """Create ``directory`` and write/remove a probe file in it; raise OSError naming it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"output directory {directory} is not writable ({e.strerror or e})") from None


def _has_checkpoint(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(p.is_dir() and p.name.isdigit() for p in ckpt_dir.iterdir())


def resume_changes(stored: dict, requested: dict) -> tuple[list[str], list[str]]:
    """-> (changed keys that are safe, changed keys that are not), dotted, sorted. Keys only one
    side has (a checkpoint older than a config key) are not compared."""
    a, b = flatten(stored), flatten(requested)
    changed = sorted(k for k in set(a) & set(b) if _norm(a[k]) != _norm(b[k]))
    safe = [k for k in changed if any(fnmatch.fnmatch(k, pat) for pat in SAFE_ON_RESUME)]
    return safe, [k for k in changed if k not in safe]


def check_resume_config(stored: dict, requested: dict) -> list[str]:
    """Raise ConfigError naming every key whose change would alter shapes or the data; returns
    the safe keys that changed (for the log)."""
    stored = {k: v for k, v in stored.items() if k != "drafter_config"}
    requested = {k: v for k, v in requested.items() if k != "drafter_config"}
    safe, unsafe = resume_changes(stored, requested)
    if unsafe:
        a, b = flatten(stored), flatten(requested)
        detail = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in unsafe)
        raise ConfigError(
            f"--resume with a config that changes the model or the data: {detail}. "
            "Only these may change on resume: " + ", ".join(SAFE_ON_RESUME) + ". Start a new run instead."
        )
    return safe


def _norm(v):
    return list(v) if isinstance(v, tuple) else v
