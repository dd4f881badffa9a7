"""``python -m dflash_jax.mesh_experiment --config NAME --layouts ...``: the command line of
``dflash_jax.tools.mesh_experiment`` (mesh layouts planned side by side; docs/mesh.md)."""

from __future__ import annotations

import sys

from dflash_jax.tools.mesh_experiment import main

if __name__ == "__main__":
    sys.exit(main())
