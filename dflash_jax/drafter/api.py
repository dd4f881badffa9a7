"""Public entry points: create a drafter for a target, or load one from disk."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.model import DFlashDrafter


def _target_config(target):
    """Accept a target model (with ``.config``) or its config."""
    return getattr(target, "config", target)


def init_drafter(config: DrafterConfig, target, rng: int | jax.Array | nnx.Rngs = 0) -> DFlashDrafter:
    """A randomly initialised drafter (linears ~ N(0, 0.02), norms 1), checked against the target.

    ``target``: the target model or its config (duck-typed; only sizes are read). None skips the check.
    """
    if target is not None:
        config.check_target(_target_config(target))
    rngs = rng if isinstance(rng, nnx.Rngs) else nnx.Rngs(params=rng)
    return DFlashDrafter(config, rngs=rngs)


def get_params(drafter: DFlashDrafter) -> dict:
    """The drafter's parameters as a nested pure dict (the layout convert/zlab_drafter maps)."""
    return nnx.to_pure_dict(nnx.state(drafter, nnx.Param))


def set_params(drafter: DFlashDrafter, params: dict) -> DFlashDrafter:
    """Replace every parameter (cast to the config's param dtype); shapes must match."""
    state = nnx.state(drafter, nnx.Param)
    pdt = jnp.dtype(drafter.config.param_dtype)
    want = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(state))
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if want != got:
        raise ValueError(f"drafter params do not match the model: expected {want}, got {got}")
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, pdt), params))
    nnx.update(drafter, state)
    return drafter


def load_drafter(path: str | Path, target, *, step: int | None = None, **overrides) -> DFlashDrafter:
    """Load a drafter from one of our orbax checkpoints (a run dir, its ``checkpoints/`` dir or a
    ``<step>`` dir; ``step`` picks one, default the latest) or an HF directory (z-lab or
    speculators layout: config.json + safetensors), via ``convert.hf_to_drafter.read_drafter``.

    ``overrides`` set our own config fields, e.g. ``attention_impl="reference"`` or
    ``compute_dtype="bfloat16"``. The drafter is checked against ``target`` (model or config)
    on its config, before any weight is read.
    """
    # convert depends on the drafter config, not the other way round: import lazily.
    from convert.hf_to_drafter import read_drafter

    check = None if target is None else (lambda c: c.check_target(_target_config(target)))
    config, params = read_drafter(path, step=step, check=check, **overrides)
    drafter = nnx.eval_shape(lambda: DFlashDrafter(config, rngs=nnx.Rngs(0)))
    return set_params(drafter, params)
