"""Create a drafter for a target and get or set its parameters (loading one from disk:
``dflash_jax.loading.load_drafter``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.model import WEIGHTS, DFlashDrafter


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


def with_attention_impl(drafter: DFlashDrafter, attention_impl: str) -> DFlashDrafter:
    """The same weights under another attention implementation (e.g. a drafter fresh from Pallas
    training, decoded where the kernel does not run); ``drafter`` itself when it already uses it."""
    cfg = drafter.config
    if attention_impl == cfg.attention_impl:
        return drafter
    cfg = cfg.replace(attention_impl=attention_impl)
    other = nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(drafter, WEIGHTS))
    return other


def get_params(drafter: DFlashDrafter) -> dict:
    """The drafter's weights as a nested pure dict (the layout convert/zlab_drafter maps): its
    parameters and, with a draft vocabulary, ``draft_vocab`` (int32 [N] target ids)."""
    return nnx.to_pure_dict(nnx.state(drafter, WEIGHTS))


def set_params(drafter: DFlashDrafter, params: dict) -> DFlashDrafter:
    """Replace every weight (parameters cast to the config's param dtype, the draft vocabulary
    kept int32); shapes must match."""
    state = nnx.state(drafter, WEIGHTS)
    pdt = jnp.dtype(drafter.config.param_dtype)
    want = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(state))
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if want != got:
        raise ValueError(f"drafter params do not match the model: expected {want}, got {got}")
    cast = {
        k: (
            jnp.asarray(v, jnp.int32)
            if k == "draft_vocab"
            else jax.tree.map(lambda x: jnp.asarray(x, pdt), v)
        )
        for k, v in params.items()
    }
    nnx.replace_by_pure_dict(state, cast)
    nnx.update(drafter, state)
    return drafter


def set_draft_vocab(drafter: DFlashDrafter, target_ids) -> DFlashDrafter:
    """Install the chosen draft vocabulary (target ids, any order; stored ascending)."""
    import numpy as np

    n = drafter.config.draft_vocab_size
    ids = np.unique(np.asarray(target_ids, np.int64))
    if n is None or ids.size != n or len(np.asarray(target_ids)) != n:
        raise ValueError(
            f"draft vocabulary of {len(np.asarray(target_ids))} ids ({ids.size} distinct) for a drafter "
            f"with draft_vocab_size={n}"
        )
    if ids[0] < 0 or ids[-1] >= drafter.config.vocab_size:
        raise ValueError(
            f"draft vocabulary ids must lie in [0, {drafter.config.vocab_size}), got {ids[0]}..{ids[-1]}"
        )
    value = drafter.draft_vocab[...]
    sharding = getattr(value, "sharding", None)
    new = jnp.asarray(ids, jnp.int32)
    drafter.draft_vocab[...] = jax.device_put(new, sharding) if sharding is not None else new
    return drafter
