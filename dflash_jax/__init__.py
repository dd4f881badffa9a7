"""dflash-jax: train DFlash block-diffusion drafters for speculative decoding in JAX/Flax.

Public API (names kept stable; resolved lazily so ``import dflash_jax`` stays cheap):
  load_target(path, *, dtype="float32", mesh=None, attention_impl="auto")   HF model dir -> target model
  DrafterConfig, init_drafter(config, target, rng), load_drafter(path, target)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_target": "dflash_jax.loading",
    "TargetConfig": "dflash_jax.target.config",
    "TargetModel": "dflash_jax.target.model",
    "DrafterConfig": "dflash_jax.drafter.config",
    "DFlashDrafter": "dflash_jax.drafter.model",
    "init_drafter": "dflash_jax.drafter.api",
    "load_drafter": "dflash_jax.loading",
    "speculative_generate": "dflash_jax.decoding.speculative",
    "evaluate": "dflash_jax.decoding.evaluation",
    "make_mesh": "dflash_jax.sharding",
    "MeshConfig": "dflash_jax.sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dflash_jax' has no attribute {name!r}")
