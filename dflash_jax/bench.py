"""``python -m dflash_jax.bench {step,attention,generate,loss,target,compare} ...``: the command line
of the benchmarks in ``dflash_jax.tools.bench`` (usage there and in BENCHMARKS.md)."""

from __future__ import annotations

import sys

from dflash_jax.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
