"""Drafter initialisation: from a warm start's weights (``init_params_from``) or from the
target's own decoder layers (``init_from_target_layers``, ``drafter.init: target``)."""

from __future__ import annotations

import logging

import jax

from dflash_jax.config_io import ConfigError

log = logging.getLogger(__name__)


def init_params_from(drafter, source, path: str) -> None:
    """Copy the warm-start ``source``'s parameters into ``drafter`` (same config but kernels)."""
    from dflash_jax.drafter.api import get_params, set_params

    params = get_params(source)
    if drafter.draft_vocab is not None and "draft_vocab" not in params:  # chosen after this
        params["draft_vocab"] = drafter.draft_vocab[...]
    set_params(drafter, params)
    log.info("initialised drafter from %s", path)


def init_from_target_layers(drafter, target, first_layer: int | None = None) -> None:
    """Start the drafter from ``num_layers`` consecutive decoder layers of the target, from
    ``first_layer`` (``drafter.init_first_layer``; default: the last ones): attention, MLP and their
    norms copied (q/k norms, absent in Llama/Qwen2, stay 1), ``hidden_norm`` as the input norm of
    the first copied layer and the final norm as the target's. ``fc`` selects one tap (the others
    start at 0): the layer before the first copied one when it is a tap, so that the context enters
    the first drafter layer as that target layer's own input (z-lab's default taps end at N-3, the
    layer before the last two), else the last tap. ``drafter.init: target``."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.drafter.api import get_params, set_params

    cfg, tc = drafter.config, target.config
    stack = getattr(target, "layers", None)
    names = set(getattr(stack, "names", ()))
    need = {"input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down"}
    extra = names - need - {"q_norm", "k_norm"}
    if not need <= names or extra:
        raise ConfigError(
            f"drafter.init=target needs a dense target without biases (its layers have {sorted(names)}); "
            "use drafter.init=random"
        )
    if (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) != (
        tc.num_heads,
        tc.num_kv_heads,
        tc.head_dim,
        tc.intermediate_size,
    ):
        raise ConfigError("drafter.init=target needs the drafter's heads and MLP width to be the target's")
    first = tc.num_layers - cfg.num_layers if first_layer is None else first_layer
    if first_layer is None and first < 0:
        raise ConfigError(
            f"drafter.init=target: the drafter's {cfg.num_layers} layers outnumber the target's {tc.num_layers}"
        )
    if not 0 <= first <= tc.num_layers - cfg.num_layers:
        raise ConfigError(
            f"drafter.init_first_layer={first_layer}: the drafter's {cfg.num_layers} layers from there "
            f"run past the target's {tc.num_layers} (the last start is {tc.num_layers - cfg.num_layers})"
        )
    w = {n: np.asarray(jax.device_get(getattr(stack, n)[...]), np.float32) for n in names}
    params = jax.tree.map(np.asarray, jax.device_get(get_params(drafter)))
    D, K = cfg.hidden_size, cfg.num_target_features
    taps = list(cfg.target_layer_ids)
    tap = taps.index(first - 1) if first - 1 in taps else K - 1
    fc = np.zeros((K * D, D), np.float32)
    fc[tap * D : (tap + 1) * D, :] = np.eye(D, dtype=np.float32)
    params["fc"] = fc
    params["hidden_norm"]["weight"] = w["input_norm"][first]
    params["norm"]["weight"] = np.asarray(jax.device_get(target.norm[...]), np.float32)
    for i in range(cfg.num_layers):
        src, layer = first + i, params["layers"][i]
        attn = layer["self_attn"]
        for ours, theirs in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
            attn[ours] = w[theirs][src]
        for norm in ("q_norm", "k_norm"):
            if norm in names:
                attn[norm]["weight"] = w[norm][src]
        layer["input_layernorm"]["weight"] = w["input_norm"][src]
        layer["post_attention_layernorm"]["weight"] = w["post_norm"][src]
        for ours, theirs in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            layer["mlp"][ours] = w[theirs][src]
    set_params(drafter, jax.tree.map(jnp.asarray, params))
    log.info(
        "initialised the drafter from target layers %d..%d (fc selects tap %d)",
        first,
        first + cfg.num_layers - 1,
        taps[tap],
    )
