"""Import an HF-format DFlash drafter (e.g. a published z-lab one) as one of our checkpoints.

  python -m convert.hf_to_drafter --hf HF_DIR --out CKPT_DIR [--num-target-layers N]

The result, ``CKPT_DIR/checkpoints/0/{state,meta,config}``, has the layout ``dflash_jax.train``
writes (drafter params only, no optimizer state), so ``dflash_jax.train --init-from CKPT_DIR``
fine-tunes it, ``dflash_jax.eval eval.drafter=CKPT_DIR`` evaluates it and ``convert.drafter_to_hf``
exports it again (identical weights with ``--dtype auto``; config.json may differ in formatting).

Both HF layouts are read: z-lab's (``dflash_config`` in a Qwen3 config.json) and the
vllm-project/speculators one (``convert.speculators``; a speculators config does not record the
target's depth: pass ``--num-target-layers`` when neither it nor its verifier's config.json has it).
A speculators import keeps its verifier, so exporting it again records the same one.

The readers themselves (ours and both HF layouts) are ``convert.drafter_reader``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from convert.drafter_reader import read_drafter, read_hf_drafter
from convert.logs import add_verbose_flag, configure_logging
from dflash_jax.checkpoint import IMPORT_KEY, write_checkpoint
from dflash_jax.cli import cli

log = logging.getLogger(__name__)


def import_hf(hf: str | Path, out: str | Path, *, num_target_layers: int | None = None) -> Path:
    """HF drafter dir -> a checkpoint directory ``out`` (see module doc)."""
    config, params, info = read_hf_drafter(hf, num_target_layers=num_target_layers)
    path = write_checkpoint(out, config, params, extra={IMPORT_KEY: info})
    log.info("imported %s drafter %s (%s) into %s", info["format"], hf, info["dtype"], path)
    return path


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
