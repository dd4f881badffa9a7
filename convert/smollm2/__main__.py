"""``python -m convert.smollm2 [--out DIR | --cache-dir DIR] [--force]``: prepare the SmolLM2 HF directory
and print it (the library is ``convert.smollm2``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from convert.logs import add_verbose_flag, configure_logging
from convert.smollm2 import prepare_smollm2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m convert.smollm2",
        description="Convert the packaged SmolLM2-135M-Instruct GGUF into an HF safetensors directory.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="exact output directory")
    where.add_argument(
        "--cache-dir", type=Path, help="cache root (default: $DFLASH_JAX_CACHE or ~/.cache/dflash_jax)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    print(prepare_smollm2(args.cache_dir, out_dir=args.out, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
