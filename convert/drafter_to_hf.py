"""Export a drafter checkpoint as an HF directory that serving stacks load.

  python -m convert.drafter_to_hf --checkpoint RUN_DIR [--step N] --out HF_DIR \
      [--format zlab|speculators] [--dtype auto|bfloat16|float16|float32] [--verifier TARGET] [-v]

``--checkpoint`` is a training run directory (``<run>/checkpoints/<step>/{state,meta,config}``,
written by ``dflash_jax.train``), its ``checkpoints/`` directory, one ``<step>`` directory of it,
or a checkpoint made by ``convert.hf_to_drafter`` (layout: ``dflash_jax.checkpoint``).

Formats:

* ``zlab`` (default): z-lab's ``DFlashDraftModel`` layout, loaded by the ``dflash`` package, SGLang
  and vLLM. ``config.json`` is a Qwen3Config (``architectures: ["DFlashDraftModel"]``,
  ``model_type: "qwen3"``) plus ``block_size``, ``num_target_layers`` and
  ``dflash_config: {target_layer_ids, mask_token_id}``; ``model.safetensors`` holds
  ``fc.weight [H, K*H]``, ``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.*`` in torch
  ``[out, in]`` layout, with ``{"format": "pt"}`` metadata. No embed_tokens / lm_head: the drafter
  uses the target's (invariant 7). No ``auto_map``: load it with ``dflash.model.DFlashDraftModel``.
* ``speculators``: the vllm-project/speculators layout vLLM serves with ``method: "dflash"``
  (``convert.speculators``). Same tensor names. The verifier it records is ``--verifier``, else the
  target the checkpoint was trained against (or imported with); the export fails when neither is
  known, since vLLM would otherwise draft with random embeddings and lm_head.

``--dtype auto`` writes the dtype a checkpoint was imported from (``convert.hf_to_drafter``), so an
import/export round trip gives identical weights (config.json may differ in formatting and derived
keys), and bfloat16 otherwise (what published drafters use; pass float32 to keep trained fp32
weights exactly).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from convert.logs import add_verbose_flag, configure_logging
from convert.speculators import write_speculators_drafter
from convert.zlab_drafter import EXPORT_DTYPES, write_zlab_drafter
from dflash_jax.checkpoint import CHECKPOINTS_SUBDIR, IMPORT_KEY, read_checkpoint, resolve_checkpoint

log = logging.getLogger(__name__)

FORMATS = ("zlab", "speculators")
DTYPES = ("auto", *EXPORT_DTYPES)
# The run directory of a ``target.path: tiny`` run keeps its random target here (dflash_jax.train).
TINY_TARGET_SUBDIR = "tiny_target"


def recorded_verifier(run_config: dict, checkpoint: str | Path, step: int | None = None) -> str | None:
    """The target a checkpoint was trained against (or the verifier it was imported with), as a
    name or path for the speculators config; None when the checkpoint records none."""
    imported = (run_config.get(IMPORT_KEY) or {}).get("verifier")
    if imported:
        return str(imported)
    path = (run_config.get("target") or {}).get("path")
    if not path:
        return None
    if path == "tiny":
        root, _ = resolve_checkpoint(checkpoint, step)
        run_dir = root.parent if root.name == CHECKPOINTS_SUBDIR else root
        tiny = run_dir / TINY_TARGET_SUBDIR
        return str(tiny) if tiny.is_dir() else None
    if path == "smollm2":
        from convert.smollm2 import default_dir

        return str(default_dir())
    return str(Path(path).resolve()) if Path(path).is_dir() else str(path)


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
        verifier = verifier if verifier is not None else recorded_verifier(run_config, checkpoint, step)
        if verifier is None:
            raise ValueError(
                f"checkpoint {checkpoint} records no target to serve as the speculators verifier: pass "
                "--verifier TARGET (the target model's HF name or directory)"
            )
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
    p.add_argument(
        "--verifier",
        default=None,
        help="speculators format: the target's name or path to record (default: the checkpoint's target)",
    )
    add_verbose_flag(p)
    args = p.parse_args(argv)
    configure_logging(args.verbose)
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


__all__ = ["export", "recorded_verifier"]

if __name__ == "__main__":
    sys.exit(main())
