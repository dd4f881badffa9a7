"""``drafter.init: target`` (drafter/init.py::init_from_target_layers): the drafter starts as a
run of the target's own decoder layers, from ``drafter.init_first_layer`` (default: the last ones),
with ``fc`` selecting the tap that is the first copied layer's input.

Reference: the HF checkpoint's own tensors (safetensors as transformers saved them), not our loader.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import save_hf_model
from safetensors.numpy import load_file

import dflash_jax
from dflash_jax.config_io import ConfigError
from dflash_jax.drafter.api import get_params, init_drafter
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.init import init_from_target_layers
from dflash_jax.nested import flatten
from dflash_jax.training.run_config import load_run_config


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_init"), seed=3)  # 4 layers


@pytest.fixture(scope="module")
def target(target_dir):
    return dflash_jax.load_target(target_dir)


def _started(target, taps, first_layer=None, num_layers=2):
    cfg = DrafterConfig.for_target(
        target.config, num_layers=num_layers, mask_token_id=7, block_size=4, target_layer_ids=taps
    )
    drafter = init_drafter(cfg, target, 0)
    init_from_target_layers(drafter, target, first_layer=first_layer)
    return {k: np.asarray(v, np.float32) for k, v in flatten(get_params(drafter)).items()}


def _hf_layer_as_ours(hf, layer, heads, kv_heads, head_dim):
    """The HF layer's tensors in the drafter's layout ([in, out] kernels, heads split out)."""
    p = f"model.layers.{layer}."
    D = hf["model.norm.weight"].shape[0]
    return {
        "self_attn.q_proj": hf[p + "self_attn.q_proj.weight"].T.reshape(D, heads, head_dim),
        "self_attn.k_proj": hf[p + "self_attn.k_proj.weight"].T.reshape(D, kv_heads, head_dim),
        "self_attn.v_proj": hf[p + "self_attn.v_proj.weight"].T.reshape(D, kv_heads, head_dim),
        "self_attn.o_proj": hf[p + "self_attn.o_proj.weight"].T.reshape(heads, head_dim, D),
        "self_attn.q_norm.weight": hf[p + "self_attn.q_norm.weight"],
        "self_attn.k_norm.weight": hf[p + "self_attn.k_norm.weight"],
        "input_layernorm.weight": hf[p + "input_layernorm.weight"],
        "post_attention_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
        "mlp.gate_proj": hf[p + "mlp.gate_proj.weight"].T,
        "mlp.up_proj": hf[p + "mlp.up_proj.weight"].T,
        "mlp.down_proj": hf[p + "mlp.down_proj.weight"].T,
    }


@pytest.mark.parametrize("first_layer, copied", [(None, (2, 3)), (1, (1, 2)), (0, (0, 1))])
def test_the_drafter_starts_as_the_named_target_layers(target, target_dir, first_layer, copied):
    hf = {k: v.astype(np.float32) for k, v in load_file(str(target_dir / "model.safetensors")).items()}
    c = target.config
    params = _started(target, (0, 1), first_layer)
    for i, src in enumerate(copied):
        for name, want in _hf_layer_as_ours(hf, src, c.num_heads, c.num_kv_heads, c.head_dim).items():
            np.testing.assert_array_equal(params[f"layers.{i}.{name}"], want, err_msg=f"layer {i} {name}")
    np.testing.assert_array_equal(
        params["hidden_norm.weight"], hf[f"model.layers.{copied[0]}.input_layernorm.weight"]
    )
    np.testing.assert_array_equal(params["norm.weight"], hf["model.norm.weight"])


@pytest.mark.parametrize(
    "taps, first_layer, selected",
    [
        ((0, 1), None, 1),  # default start 2: tap 1 is its input
        ((0, 2), None, 1),  # layer 1 is no tap: the last tap
        ((0, 2), 1, 0),  # start 1: tap 0 is its input, though not the last tap
        ((1, 2), 1, 1),  # layer 0 is no tap: the last
        ((0, 1, 2), 2, 1),
    ],
)
def test_fc_selects_the_tap_that_is_the_first_copied_layers_input(target, taps, first_layer, selected):
    fc = _started(target, taps, first_layer)["fc"]
    D = target.config.hidden_size
    for k in range(len(taps)):
        block = fc[k * D : (k + 1) * D]
        np.testing.assert_array_equal(
            block, np.eye(D) if k == selected else np.zeros((D, D)), err_msg=f"tap {k}"
        )


def test_a_start_past_the_target_is_refused_naming_the_field(target):
    with pytest.raises(ConfigError, match=r"drafter.init_first_layer=3.*last start is 2"):
        _started(target, (0, 1), first_layer=3)
    with pytest.raises(ConfigError, match="outnumber the target's 4"):
        _started(target, (0, 1), num_layers=5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["drafter.init_first_layer=1"], "needs drafter.init=target"),
        (["drafter.init=target", "drafter.init_first_layer=-1"], "init_first_layer must be >= 0"),
    ],
)
def test_bad_init_first_layer_is_refused_at_load(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        load_run_config("tiny", overrides)
