"""Import an HF-format DFlash drafter (e.g. a published z-lab one) as one of our checkpoints.

  python -m convert.hf_to_drafter --hf HF_DIR --out CKPT_DIR [--num-target-layers N]

The result, ``CKPT_DIR/checkpoints/0/{state,meta,config}``, has the layout ``dflash_jax.train``
writes (drafter params only, no optimizer state), so ``dflash_jax.train --init-from CKPT_DIR``
fine-tunes it, ``dflash_jax.eval --drafter CKPT_DIR`` evaluates it and ``convert.drafter_to_hf``
exports it again (identical weights with ``--dtype auto``; config.json may differ in formatting).

Both HF layouts are read: z-lab's (``dflash_config`` in a Qwen3 config.json) and the
vllm-project/speculators one (``convert.speculators``; a speculators config does not record the
target's depth: pass ``--num-target-layers`` when neither it nor its verifier's config.json has it).
A speculators import keeps its verifier, so exporting it again records the same one.

``read_drafter(path)`` is the one reader behind ``dflash_jax.load_drafter``: it accepts our
checkpoints as well as both HF layouts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from convert.logs import add_verbose_flag, configure_logging
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
    IMPORT_KEY,
    is_checkpoint_dir,
    nonfinite_params,
    read_checkpoint,
    write_checkpoint,
)
from dflash_jax.cli import cli
from dflash_jax.drafter.config import DrafterConfig

log = logging.getLogger(__name__)


def _read_config_json(path: Path) -> dict:
    f = path / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}: not an HF drafter directory")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e


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
    raw = _read_config_json(path)
    fmt = "speculators" if MARKER_KEY in raw else "zlab"
    zcfg = speculators_to_zlab(raw, num_target_layers=num_target_layers) if fmt == "speculators" else raw
    if fmt == "speculators" and draft_vocab_size_of(raw) is not None:
        overrides = {"draft_vocab_size": draft_vocab_size_of(raw), **overrides}
    try:
        config = DrafterConfig.from_hf_dict(zcfg, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / CONFIG_FILE}: {e}") from e
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


def import_hf(hf: str | Path, out: str | Path, *, num_target_layers: int | None = None) -> Path:
    """HF drafter dir -> a checkpoint directory ``out`` (see module doc)."""
    config, params, info = read_hf_drafter(hf, num_target_layers=num_target_layers)
    path = write_checkpoint(out, config, params, extra={IMPORT_KEY: info})
    log.info("imported %s drafter %s (%s) into %s", info["format"], hf, info["dtype"], path)
    return path


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


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert.hf_to_drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF drafter directory (z-lab or speculators layout)")
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument(
        "--num-target-layers", type=int, default=None, help="speculators configs only, when not recorded"
    )
    add_verbose_flag(p)
    args = p.parse_args(argv)
    configure_logging(args.verbose)
    path = import_hf(args.hf, args.out, num_target_layers=args.num_target_layers)
    print(path)
    return 0


__all__ = ["import_hf", "read_drafter", "read_hf_drafter"]

if __name__ == "__main__":
    sys.exit(main())
