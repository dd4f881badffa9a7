"""Create a drafter for a target and get or set its parameters (loading one from disk:
``dflash_jax.loading.load_drafter``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.model import DFlashDrafter


def target_config_of(target):
    """Accept a target model (with ``.config``) or its config."""
    return getattr(target, "config", target)


def init_drafter(config: DrafterConfig, target, rng: int | jax.Array | nnx.Rngs = 0) -> DFlashDrafter:
    """A randomly initialised drafter (linears ~ N(0, 0.02), norms 1), checked against the target.

    ``target``: the target model or its config (duck-typed; only sizes are read). None skips the check.
    """
    if target is not None:
        config.check_target(target_config_of(target))
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
