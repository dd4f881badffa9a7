"""z-lab DFlash drafter checkpoints <-> our drafter parameters, both directions in one place.

A z-lab drafter directory holds ``config.json`` (a Qwen3Config plus ``num_target_layers``,
``block_size`` and ``dflash_config``) and ``model.safetensors`` (or sharded with an index) with
torch ``nn.Linear`` weights ``[out, in]``. There is no embed_tokens / lm_head (invariant 7).

The mapping is ``KeyRule`` data (``convert.hf_mapping``, shared with the targets): one rule per
parameter, ``our path <-> HF key``. Our parameters are a nested "pure dict"
(``nnx.to_pure_dict``); paths join its keys with dots, and their shapes come from the model
itself (``nnx.eval_shape``). Every HF key must be consumed and every parameter produced: a
missing or unexpected key is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from convert.hf_mapping import KeyRule, check_tensors, entries, hf_shape, to_hf, to_ours
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.dtypes import DTYPE_NAMES, to_dtype
from dflash_jax.nested import flatten, unflatten

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EXPORT_DTYPES = DTYPE_NAMES  # the one dtype table (dflash_jax.dtypes)

_L = "layers.{i}."
DRAFTER_RULES = (
    KeyRule("fc", "fc.weight", "linear"),
    KeyRule("hidden_norm.weight", "hidden_norm.weight", "vector"),
    KeyRule("norm.weight", "norm.weight", "vector"),
    KeyRule(_L + "input_layernorm.weight", _L + "input_layernorm.weight", "vector"),
    KeyRule(_L + "post_attention_layernorm.weight", _L + "post_attention_layernorm.weight", "vector"),
    KeyRule(_L + "self_attn.q_proj", _L + "self_attn.q_proj.weight", "linear"),
    KeyRule(_L + "self_attn.k_proj", _L + "self_attn.k_proj.weight", "linear"),
    KeyRule(_L + "self_attn.v_proj", _L + "self_attn.v_proj.weight", "linear"),
    KeyRule(_L + "self_attn.o_proj", _L + "self_attn.o_proj.weight", "linear", in_dims=2),
    KeyRule(_L + "self_attn.q_norm.weight", _L + "self_attn.q_norm.weight", "vector"),
    KeyRule(_L + "self_attn.k_norm.weight", _L + "self_attn.k_norm.weight", "vector"),
    KeyRule(_L + "mlp.gate_proj", _L + "mlp.gate_proj.weight", "linear"),
    KeyRule(_L + "mlp.up_proj", _L + "mlp.up_proj.weight", "linear"),
    KeyRule(_L + "mlp.down_proj", _L + "mlp.down_proj.weight", "linear"),
)


def param_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes by dotted path, as ``DFlashDrafter`` creates them (no arrays allocated)."""
    from flax import nnx

    from dflash_jax.drafter.model import DFlashDrafter

    abstract = nnx.eval_shape(lambda: DFlashDrafter(config, rngs=nnx.Rngs(0)))
    return {k: tuple(v.shape) for k, v in flatten(nnx.to_pure_dict(nnx.state(abstract, nnx.Param))).items()}


def _entries(config: DrafterConfig):
    return entries(DRAFTER_RULES, config.num_layers)


def hf_to_params(state: dict[str, np.ndarray], config: DrafterConfig) -> dict:
    """HF-named tensors -> our nested pure dict (numpy). Strict key and shape accounting."""
    shapes = param_shapes(config)
    expected = {hf: hf_shape(rule, shapes[ours]) for rule, ours, hf, _ in _entries(config)}
    check_tensors("z-lab drafter", expected, {k: tuple(np.shape(v)) for k, v in state.items()})
    return unflatten(
        {ours: to_ours(rule, np.asarray(state[hf]), shapes[ours]) for rule, ours, hf, _ in _entries(config)}
    )


def params_to_hf(params: dict, config: DrafterConfig, dtype=None) -> dict[str, np.ndarray]:
    """Our nested pure dict -> HF-named numpy tensors (``dtype``: e.g. ml_dtypes.bfloat16)."""
    flat = flatten(params)
    check_tensors("drafter params", param_shapes(config), {k: tuple(np.shape(v)) for k, v in flat.items()})
    out = {}
    for rule, ours, hf, _ in _entries(config):
        x = np.asarray(flat[ours])
        out[hf] = to_hf(rule, x if dtype is None else x.astype(dtype))
    return out


# ------------------------------------------------------------------------------------------
# Directories
# ------------------------------------------------------------------------------------------


def write_hf_drafter(
    path: str | Path, config: DrafterConfig, params: dict, dtype: str, hf_config: dict, extra_tensors=None
) -> Path:
    """Write ``hf_config`` as config.json and the drafter's tensors (plus ``extra_tensors``, as
    given) as model.safetensors."""
    from safetensors.numpy import save_file

    tensors = params_to_hf(params, config, to_dtype(dtype))
    tensors.update(extra_tensors or {})
    # Checked after the cast, on what is written: finite float32 values beyond float16's range
    # (65504) become inf here.
    bad = [n for n, t in tensors.items() if t.dtype.kind not in "biu" and not np.isfinite(t).all()]
    if bad:
        raise FloatingPointError(
            f"refusing to export as {dtype}: tensors not finite after the cast to {dtype} "
            f"(values beyond its range): {', '.join(bad[:5])}; export as float32 or bfloat16"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    return path


def write_zlab_drafter(
    path: str | Path, config: DrafterConfig, params: dict, dtype: str = "bfloat16"
) -> Path:
    """Write a z-lab-format drafter dir (config.json + model.safetensors) loadable by
    ``dflash.model.DFlashDraftModel.from_pretrained``. ``dtype``: float32 | bfloat16 | float16."""
    return write_hf_drafter(path, config, params, dtype, config.to_hf_dict(dtype=dtype))
