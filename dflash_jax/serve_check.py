"""``python -m dflash_jax.serve_check --config RUN_DIR``: the train-to-serve consistency gate of
``dflash_jax.tools.serve_check`` (usage there and in the README's "Serve it")."""

from __future__ import annotations

import sys

from dflash_jax.tools.serve_check import main

if __name__ == "__main__":
    sys.exit(main())
