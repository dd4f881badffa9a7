"""Reading a drafter from any of its formats: our orbax checkpoints, z-lab's HF layout and the
vllm-project/speculators one. ``read_drafter`` is the one reader behind ``dflash_jax.load_drafter``,
warm starts, ``python -m convert.hf_to_drafter`` and the exporter's round trips."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from convert.safetensors_io import CheckpointReader
from convert.speculators import (
    D2T_KEY,
    MARKER_KEY,
    T2D_KEY,
    VOCAB_TENSOR_KEYS,
    draft_vocab_of,
    draft_vocab_size_of,
    speculators_to_zlab,
    verifier_of,
)
from convert.zlab_drafter import CONFIG_FILE, EXPORT_DTYPES, hf_to_params
from dflash_jax.checkpoint import (
    DRAFTER_CONFIG_KEY,
    is_checkpoint_dir,
    nonfinite_params,
    read_checkpoint,
    read_checkpoint_config,
)
from dflash_jax.drafter.config import DrafterConfig

__all__ = ["read_drafter", "read_drafter_config", "read_hf_drafter"]


def _read_config_json(path: Path) -> dict:
    f = path / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}: not an HF drafter directory")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e


def _hf_config(path: Path, num_target_layers: int | None, overrides: dict) -> tuple[DrafterConfig, dict, str]:
    """An HF drafter dir's config.json -> (DrafterConfig, the raw dict, "zlab" | "speculators")."""
    raw = _read_config_json(path)
    fmt = "speculators" if MARKER_KEY in raw else "zlab"
    zcfg = speculators_to_zlab(raw, num_target_layers=num_target_layers) if fmt == "speculators" else raw
    if fmt == "speculators" and draft_vocab_size_of(raw) is not None:
        overrides = {"draft_vocab_size": draft_vocab_size_of(raw), **overrides}
    try:
        config = DrafterConfig.from_hf_dict(zcfg, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / CONFIG_FILE}: {e}") from e
    return config, raw, fmt


def read_hf_drafter(
    path: str | Path, *, num_target_layers: int | None = None, check=None, **overrides
) -> tuple[DrafterConfig, dict, dict]:
    """An HF drafter dir (z-lab or speculators) -> (DrafterConfig, params as numpy, info).

    ``info``: ``{"format", "dtype", "path"}``, plus ``verifier`` when a speculators config names
    one. The config is parsed and validated, and passed to ``check`` (e.g. a fit test against the
    target), before any tensor is read; a corrupt or inconsistent safetensors file is an error
    naming the file.
    """
    path = Path(path)
    config, raw, fmt = _hf_config(path, num_target_layers, overrides)
    if check is not None:
        check(config)
    reader = CheckpointReader(path)
    dtypes = {str(reader.get(k).dtype) for k in reader.keys()}
    tensors = {k: np.array(v) for k, v in reader.items()}
    vocab = None
    if config.draft_vocab_size is not None:
        missing = [k for k in (T2D_KEY, D2T_KEY) if k not in tensors]
        if missing:
            raise ValueError(
                f"{path}: draft_vocab_size={config.draft_vocab_size} but no {' or '.join(missing)} tensor"
            )
        try:
            vocab = draft_vocab_of(
                tensors[T2D_KEY],
                tensors[D2T_KEY],
                draft_vocab_size=config.draft_vocab_size,
                vocab_size=config.vocab_size,
            )
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        # lm_head rows are the verifier's own (frozen, invariant 7): ours come from the target.
        tensors = {k: v for k, v in tensors.items() if k not in VOCAB_TENSOR_KEYS}
        dtypes = {str(reader.get(k).dtype) for k in tensors}
    try:
        params = hf_to_params(tensors, config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if vocab is not None:
        params["draft_vocab"] = vocab
    dtype = next(iter(dtypes)) if len(dtypes) == 1 and dtypes <= set(EXPORT_DTYPES) else None
    info = {"format": fmt, "dtype": dtype, "path": str(path.resolve())}
    if fmt == "speculators" and verifier_of(raw):
        info["verifier"] = verifier_of(raw)
    return config, params, info


def read_drafter(
    path: str | Path, *, step: int | None = None, check=None, **overrides
) -> tuple[DrafterConfig, dict]:
    """Any drafter source -> (DrafterConfig, params as numpy): one of our checkpoints (run dir,
    checkpoints dir or step dir; ``step`` picks one, default the latest) or an HF directory in
    z-lab or speculators layout. ``overrides`` replace DrafterConfig fields; ``check(config)`` runs
    before any weight is read (raise there to reject the drafter)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"drafter path {path} does not exist")
    if is_checkpoint_dir(path):
        config, params, _ = read_checkpoint(path, step, check=check, **overrides)
    else:
        if step is not None:
            raise ValueError(f"step={step} was given but {path} is an HF directory, not a checkpoint")
        config, params, _ = read_hf_drafter(path, check=check, **overrides)
    # Every user of a drafter (eval, warm starts, import, export) reads it here: NaN weights would
    # score tau 1.0 or train from garbage without a word.
    bad = nonfinite_params(params)
    if bad:
        raise FloatingPointError(f"drafter {path}: parameters not finite: {', '.join(bad[:5])}")
    return config, params


def read_drafter_config(path: str | Path, *, step: int | None = None, **overrides) -> DrafterConfig:
    """The DrafterConfig of any drafter source ``read_drafter`` accepts, reading no weight."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"drafter path {path} does not exist")
    if is_checkpoint_dir(path):
        stored, _ = read_checkpoint_config(path, step)
        config = DrafterConfig.from_dict(stored[DRAFTER_CONFIG_KEY])
        return config.replace(**overrides) if overrides else config
    return _hf_config(path, None, overrides)[0]
