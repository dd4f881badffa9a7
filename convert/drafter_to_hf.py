"""Export a drafter checkpoint as an HF directory that serving stacks load.

  python -m convert.drafter_to_hf --checkpoint RUN_DIR [--step N] --out HF_DIR \
      [--format zlab|speculators] [--dtype auto|bfloat16|float16|float32] [--verifier TARGET]

``--checkpoint`` is a training run directory (``<run>/checkpoints/<step>/{state,meta,config}``,
written by ``dflash_jax.train``), its ``checkpoints/`` directory, one ``<step>`` directory of it,
or a checkpoint made by ``convert.hf_to_drafter``.

Formats:

* ``zlab`` (default): z-lab's ``DFlashDraftModel`` layout, loaded by the ``dflash`` package, SGLang
  and vLLM. ``config.json`` is a Qwen3Config (``architectures: ["DFlashDraftModel"]``,
  ``model_type: "qwen3"``) plus ``block_size``, ``num_target_layers`` and
  ``dflash_config: {target_layer_ids, mask_token_id}``; ``model.safetensors`` holds
  ``fc.weight [H, K*H]``, ``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.*`` in torch
  ``[out, in]`` layout, with ``{"format": "pt"}`` metadata. No embed_tokens / lm_head: the drafter
  uses the target's (invariant 7).
* ``speculators``: the vllm-project/speculators layout vLLM serves with ``method: "dflash"``
  (``speculators_model_type: "dflash"``, the draft decoder in ``transformer_layer_config``,
  ``speculators_config`` with a greedy proposal of ``block_size - 1`` tokens). Same tensor names.
  Its ``aux_hidden_state_layer_ids`` count layers the way vLLM's EAGLE-3 hooks do, one more than
  z-lab's ``target_layer_ids`` (vLLM maps them back with ``target_layer_ids = aux - 1``).

``--dtype auto`` writes the dtype a checkpoint was imported from (``convert.hf_to_drafter``), so an
import/export round trip is byte-identical, and bfloat16 otherwise (what published drafters use;
pass float32 to keep trained fp32 weights exactly).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from convert.zlab_drafter import CONFIG_FILE, WEIGHTS_FILE, params_to_hf, write_zlab_drafter
from dflash_jax.drafter.config import FULL_ATTENTION, SLIDING_ATTENTION, DrafterConfig

log = logging.getLogger(__name__)

FORMATS = ("zlab", "speculators")
DTYPES = ("auto", "bfloat16", "float16", "float32")
CHECKPOINTS_SUBDIR = "checkpoints"
# The item names of a checkpoint step (see dflash_jax.training.checkpoint.Checkpointer).
STATE_ITEM, META_ITEM, CONFIG_ITEM = "state", "meta", "config"
DRAFTER_CONFIG_KEY = "drafter_config"
IMPORT_KEY = "imported_from"


class CheckpointError(ValueError):
    pass


# ------------------------------------------------------------------------------------------
# Reading our orbax checkpoints
# ------------------------------------------------------------------------------------------


def _steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def resolve_checkpoint(path: str | Path, step: int | None = None) -> tuple[Path, int]:
    """-> (the directory holding ``<step>/`` subdirectories, the step). Latest step by default.

    Accepts a run directory (with ``checkpoints/``), the ``checkpoints/`` directory itself, or a
    ``<step>`` directory (then ``step`` must be None or equal to it).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {path} is not a directory")
    if (path / STATE_ITEM).is_dir() and path.name.isdigit():
        if step is not None and step != int(path.name):
            raise CheckpointError(f"{path} is the checkpoint of step {path.name}, but step {step} was asked")
        return path.parent, int(path.name)
    root = path / CHECKPOINTS_SUBDIR if _steps(path / CHECKPOINTS_SUBDIR) else path
    steps = _steps(root)
    if not steps:
        raise CheckpointError(
            f"no checkpoint steps in {path} (expected {path}/checkpoints/<step>/ or {path}/<step>/)"
        )
    if step is None:
        return root, steps[-1]
    if step not in steps:
        raise CheckpointError(f"no step {step} in {root}; available steps: {steps}")
    return root, step


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like one of our orbax checkpoints (not an HF directory)."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file() and not (path / CHECKPOINTS_SUBDIR).is_dir():
        return False
    try:
        resolve_checkpoint(path)
    except (FileNotFoundError, CheckpointError):
        return False
    return True


def _short(e: Exception, limit: int = 600) -> str:
    """Orbax errors can print whole trees; keep the start."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _manager(root: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(root.resolve(), options=ocp.CheckpointManagerOptions(create=False))


def read_checkpoint_config(path: str | Path, step: int | None = None) -> tuple[dict, int]:
    """-> (the JSON config stored with the checkpoint, its step). No arrays are read."""
    import orbax.checkpoint as ocp

    root, step = resolve_checkpoint(path, step)
    manager = _manager(root)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()}))
    except Exception as e:  # noqa: BLE001 - orbax raises many types; name the checkpoint
        raise CheckpointError(f"cannot read the config of checkpoint {root / str(step)}: {_short(e)}") from e
    finally:
        manager.close()
    config = dict(restored[CONFIG_ITEM])
    if DRAFTER_CONFIG_KEY not in config:
        raise CheckpointError(
            f"checkpoint {root / str(step)}: its config has no {DRAFTER_CONFIG_KEY!r} (not a drafter checkpoint?)"
        )
    return config, step


def read_checkpoint(
    path: str | Path, step: int | None = None, *, check=None, **overrides
) -> tuple[DrafterConfig, dict, dict]:
    """-> (DrafterConfig, drafter params as a nested dict of numpy arrays, the stored run config).

    Only the drafter parameters are read (the optimizer state is skipped). ``overrides`` replace
    DrafterConfig fields (attention_impl, compute_dtype, ...); ``check(config)`` runs before any
    array is read.
    """
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from dflash_jax.drafter.model import DFlashDrafter

    run_config, step = read_checkpoint_config(path, step)
    config = DrafterConfig.from_dict(run_config[DRAFTER_CONFIG_KEY])
    if overrides:
        config = config.replace(**overrides)
    if check is not None:
        check(config)
    abstract = nnx.eval_shape(lambda: DFlashDrafter(config, rngs=nnx.Rngs(0)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nnx.to_pure_dict(nnx.state(abstract, nnx.Param)),
    )
    root, step = resolve_checkpoint(path, step)
    manager = _manager(root)
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    # Only the params: the optimizer state stays on disk.
                    STATE_ITEM: ocp.args.PyTreeRestore(
                        {"params": target},
                        restore_args=ocp.checkpoint_utils.construct_restore_args({"params": target}),
                        partial_restore=True,
                    )
                }
            ),
        )
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"cannot restore drafter params from {root / str(step)} with the stored drafter_config "
            f"({config.num_layers} layers, hidden {config.hidden_size}, {config.num_target_features} target layers): "
            f"{_short(e)}"
        ) from e
    finally:
        manager.close()
    params = jax.tree.map(np.asarray, restored[STATE_ITEM]["params"])
    return config, params, run_config


# ------------------------------------------------------------------------------------------
# speculators format
# ------------------------------------------------------------------------------------------


def _decoder_dict(config: DrafterConfig) -> dict:
    """The Qwen3 decoder fields of our z-lab config (what speculators' transformer_layer_config holds)."""
    z = config.to_hf_dict()
    drop = ("architectures", "auto_map", "block_size", "dflash_config", "is_causal")
    return {k: v for k, v in z.items() if k not in drop}


def speculators_config(
    config: DrafterConfig, *, dtype: str | None = None, verifier: str | Path | None = None
) -> dict:
    """The config.json of a vllm-project/speculators DFlash drafter (see module doc)."""
    if config.embedding_scale != 1.0 or config.logit_scale != 1.0 or config.logit_softcap is not None:
        raise ValueError(
            "the speculators format has no input_embedding_scale / output_multiplier / final_logit_softcapping; "
            "export this drafter with --format zlab"
        )
    sliding = SLIDING_ATTENTION in config.layer_types
    if config.causal_in_block is True and FULL_ATTENTION in config.layer_types:
        raise ValueError(
            "causal_in_block=True on full-attention layers cannot be expressed in the speculators format "
            "(its full-attention layers are always bidirectional); export with --format zlab"
        )
    non_causal = config.causal_in_block is False  # None: z-lab's rule = sliding layers causal
    decoder = _decoder_dict(config)
    if dtype is not None:
        decoder["dtype"] = dtype
    verifier_cfg = {"name_or_path": None, "architectures": []}
    if verifier is not None:
        verifier_cfg["name_or_path"] = str(verifier)
        vcfg = Path(verifier) / CONFIG_FILE
        if vcfg.is_file():
            verifier_cfg["architectures"] = list(json.loads(vcfg.read_text()).get("architectures") or [])
    out = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": decoder,
        "draft_vocab_size": config.vocab_size,
        "target_hidden_size": config.hidden_size,
        "block_size": config.block_size,
        # vLLM's convention: aux id = z-lab target_layer_id + 1 (it maps back with aux - 1).
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": non_causal,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": verifier_cfg,
        },
    }
    if sliding:  # newer vLLM reads the window layout at the top level as well
        for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
            out[key] = decoder[key]
    if dtype is not None:
        out["dtype"] = dtype
    return out


def write_speculators_drafter(
    path: str | Path, config: DrafterConfig, params: dict, dtype: str = "bfloat16", verifier=None
) -> Path:
    from safetensors.numpy import save_file

    tensors = params_to_hf(params, config, _np_dtype(dtype))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = speculators_config(config, dtype=dtype, verifier=verifier)
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    return path


def _np_dtype(dtype: str):
    import ml_dtypes

    table = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if dtype not in table:
        raise ValueError(f"unsupported export dtype {dtype!r}; choose one of {sorted(table)}")
    return table[dtype]


# ------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    fmt: str = "zlab",
    dtype: str = "auto",
    verifier: str | Path | None = None,
) -> Path:
    """Write the drafter of ``checkpoint`` (see module doc) to ``out`` in format ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {DTYPES}")
    config, params, run_config = read_checkpoint(checkpoint, step)
    if dtype == "auto":
        dtype = (run_config.get(IMPORT_KEY) or {}).get("dtype") or "bfloat16"
    if fmt == "zlab":
        path = write_zlab_drafter(out, config, params, dtype=dtype)
    else:
        if verifier is None:
            tpath = (run_config.get("target") or {}).get("path")
            verifier = tpath if tpath and Path(tpath).is_dir() else None
        path = write_speculators_drafter(out, config, params, dtype=dtype, verifier=verifier)
    log.info("exported %s drafter (%s) to %s", fmt, dtype, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert.drafter_to_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="run dir, its checkpoints/ dir, or one <step> dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--format", default="zlab", choices=FORMATS)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--verifier", default=None, help="speculators format: the target's name or path to record")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = export(
            args.checkpoint,
            args.out,
            step=args.step,
            fmt=args.format,
            dtype=args.dtype,
            verifier=args.verifier,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


__all__ = [
    "CheckpointError",
    "export",
    "is_checkpoint_dir",
    "read_checkpoint",
    "read_checkpoint_config",
    "resolve_checkpoint",
    "speculators_config",
    "write_speculators_drafter",
]

if __name__ == "__main__":
    sys.exit(main())
