"""Import an HF-format DFlash drafter (e.g. a published z-lab one) as one of our checkpoints.

  python -m convert.hf_to_drafter --hf HF_DIR --out CKPT_DIR [--num-target-layers N]

The result, ``CKPT_DIR/checkpoints/0/{state,meta,config}``, has the layout ``dflash_jax.train``
writes (drafter params only, no optimizer state), so ``dflash_jax.train --init-from CKPT_DIR``
fine-tunes it, ``dflash_jax.eval --drafter CKPT_DIR`` evaluates it and ``convert.drafter_to_hf``
exports it again (byte-identical with ``--dtype auto``).

Both HF layouts are read: z-lab's (``dflash_config`` in a Qwen3 config.json) and the
vllm-project/speculators one (``speculators_model_type: "dflash"``; its
``aux_hidden_state_layer_ids`` are z-lab ids + 1). A speculators config does not record the
target's depth: it is taken from ``transformer_layer_config.num_target_layers`` when present (our
export writes it), else from the verifier's config.json when that path exists, else from
``--num-target-layers``.

``read_drafter(path)`` is the one reader behind ``dflash_jax.drafter.api.load_drafter``: it accepts
our checkpoints as well as both HF layouts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from convert.drafter_to_hf import (
    CHECKPOINTS_SUBDIR,
    CONFIG_ITEM,
    DRAFTER_CONFIG_KEY,
    IMPORT_KEY,
    META_ITEM,
    STATE_ITEM,
    is_checkpoint_dir,
    read_checkpoint,
)
from convert.safetensors_io import CheckpointReader
from convert.zlab_drafter import CONFIG_FILE, hf_to_params
from dflash_jax.drafter.config import DrafterConfig

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _read_config_json(path: Path) -> dict:
    f = path / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}: not an HF drafter directory")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e


def speculators_to_zlab(cfg: dict, *, num_target_layers: int | None = None) -> dict:
    """A speculators DFlash config.json dict -> the equivalent z-lab config dict."""
    if cfg.get("speculators_model_type") != "dflash":
        raise ValueError(
            f"speculators config: speculators_model_type={cfg.get('speculators_model_type')!r}; only 'dflash' is supported"
        )
    for key in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id"):
        if cfg.get(key) is None:
            raise ValueError(f"speculators config: missing {key!r}")
    if cfg.get("projector_type", "dflash") != "dflash":
        raise ValueError(f"speculators config: projector_type={cfg['projector_type']!r} is not supported")
    decoder = dict(cfg["transformer_layer_config"])
    vocab = decoder.get("vocab_size")
    if cfg.get("draft_vocab_size") not in (None, vocab):
        raise ValueError(
            f"speculators config: draft_vocab_size={cfg['draft_vocab_size']} differs from vocab_size={vocab}; "
            "reduced draft vocabularies (d2t/t2d) are not supported"
        )
    for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
        if key in cfg:
            decoder[key] = cfg[key]
    n_target = decoder.pop("num_target_layers", None) or cfg.get("num_target_layers") or num_target_layers
    if n_target is None:
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        vcfg = Path(verifier) / CONFIG_FILE if verifier else None
        if vcfg is not None and vcfg.is_file():
            v = json.loads(vcfg.read_text())
            n_target = v.get("num_hidden_layers") or (v.get("text_config") or {}).get("num_hidden_layers")
    if n_target is None:
        raise ValueError(
            "speculators config does not record the target's number of layers: pass --num-target-layers"
        )
    non_causal = bool(cfg.get("sliding_window_non_causal", False))
    out = dict(decoder)
    out.update(
        architectures=["DFlashDraftModel"],
        model_type=decoder.get("model_type", "qwen3"),
        num_target_layers=int(n_target),
        block_size=int(cfg.get("block_size", 8)),
        dflash_config={
            "mask_token_id": int(cfg["mask_token_id"]),
            "target_layer_ids": [int(i) - 1 for i in cfg["aux_hidden_state_layer_ids"]],
        },
    )
    if non_causal:
        out["is_causal"] = False
    return out


def read_hf_drafter(
    path: str | Path, *, num_target_layers: int | None = None, check=None, **overrides
) -> tuple[DrafterConfig, dict, dict]:
    """An HF drafter dir (z-lab or speculators) -> (DrafterConfig, params as numpy, info).

    ``info``: ``{"format", "dtype", "path"}``. The config is parsed and validated, and passed to
    ``check`` (e.g. a fit test against the target), before any tensor is read; a corrupt or
    inconsistent safetensors file is an error naming the file.
    """
    path = Path(path)
    raw = _read_config_json(path)
    fmt = "speculators" if "speculators_model_type" in raw else "zlab"
    zcfg = speculators_to_zlab(raw, num_target_layers=num_target_layers) if fmt == "speculators" else raw
    try:
        config = DrafterConfig.from_hf_dict(zcfg, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / CONFIG_FILE}: {e}") from e
    if check is not None:
        check(config)
    reader = CheckpointReader(path)
    dtypes = {str(reader.get(k).dtype) for k in reader.keys()}
    tensors = {k: np.array(v) for k, v in reader.items()}
    try:
        params = hf_to_params(tensors, config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    dtype = _DTYPE_NAMES.get(dtypes.pop()) if len(dtypes) == 1 else None
    return config, params, {"format": fmt, "dtype": dtype, "path": str(path.resolve())}


def write_checkpoint(
    out: str | Path, config: DrafterConfig, params: dict, *, step: int = 0, extra: dict | None = None
) -> Path:
    """Write ``params`` as step ``step`` of ``out/checkpoints`` in the trainer's layout."""
    import jax
    import orbax.checkpoint as ocp

    root = (Path(out) / CHECKPOINTS_SUBDIR).resolve()
    if (root / str(step)).exists():
        raise FileExistsError(f"{root / str(step)} already exists; choose another --out")
    run_config = {DRAFTER_CONFIG_KEY: config.to_dict(), **(extra or {})}
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=True))
    try:
        manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardSave({"params": jax.tree.map(np.asarray, params)}),
                    META_ITEM: ocp.args.JsonSave({"step": int(step), "data_state": None}),
                    CONFIG_ITEM: ocp.args.JsonSave(run_config),
                }
            ),
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    return root / str(step)


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
        return config, params
    if step is not None:
        raise ValueError(f"step={step} was given but {path} is an HF directory, not a checkpoint")
    config, params, _ = read_hf_drafter(path, check=check, **overrides)
    return config, params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert.hf_to_drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF drafter directory (z-lab or speculators layout)")
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument(
        "--num-target-layers", type=int, default=None, help="speculators configs only, when not recorded"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = import_hf(args.hf, args.out, num_target_layers=args.num_target_layers)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


__all__ = ["import_hf", "read_drafter", "read_hf_drafter", "speculators_to_zlab", "write_checkpoint"]

if __name__ == "__main__":
    sys.exit(main())
