"""z-lab DFlash drafter checkpoints <-> our drafter parameters, both directions in one place.

A z-lab drafter directory holds ``config.json`` (a Qwen3Config plus ``num_target_layers``,
``block_size`` and ``dflash_config``) and ``model.safetensors`` (or sharded with an index) with
torch ``nn.Linear`` weights ``[out, in]``. There is no embed_tokens / lm_head (invariant 7).

The mapping is data: one rule per parameter, ``our path <-> HF key``, with a layout transform.
Our parameters are a nested "pure dict" (``nnx.to_pure_dict``); paths below join its keys with
dots. Every HF key must be consumed and every parameter produced: a missing or unexpected key is
an error naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_jax.drafter.config import DrafterConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Rule:
    """``ours`` / ``hf`` are templates over ``{i}`` (layer index).

    ``layout``: ``copy`` (same array) or ``linear``: ours is ``[*in_dims, *out_dims]`` with
    ``n_in`` leading input dims, HF is ``[prod(out_dims), prod(in_dims)]``.
    """

    ours: str
    hf: str
    layout: str = "copy"
    n_in: int = 1


_GLOBAL_RULES = (
    Rule("fc", "fc.weight", "linear", 1),
    Rule("hidden_norm.weight", "hidden_norm.weight"),
    Rule("norm.weight", "norm.weight"),
)
_LAYER_RULES = (
    Rule("layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight"),
    Rule("layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm.weight"),
    Rule("layers.{i}.self_attn.q_proj", "layers.{i}.self_attn.q_proj.weight", "linear", 1),
    Rule("layers.{i}.self_attn.k_proj", "layers.{i}.self_attn.k_proj.weight", "linear", 1),
    Rule("layers.{i}.self_attn.v_proj", "layers.{i}.self_attn.v_proj.weight", "linear", 1),
    Rule("layers.{i}.self_attn.o_proj", "layers.{i}.self_attn.o_proj.weight", "linear", 2),
    Rule("layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.q_norm.weight"),
    Rule("layers.{i}.self_attn.k_norm.weight", "layers.{i}.self_attn.k_norm.weight"),
    Rule("layers.{i}.mlp.gate_proj", "layers.{i}.mlp.gate_proj.weight", "linear", 1),
    Rule("layers.{i}.mlp.up_proj", "layers.{i}.mlp.up_proj.weight", "linear", 1),
    Rule("layers.{i}.mlp.down_proj", "layers.{i}.mlp.down_proj.weight", "linear", 1),
)


def param_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes by dotted path (the layout DFlashDrafter creates)."""
    D, F, N, K, H = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    shapes = {"fc": (config.feature_size, D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
                p + "self_attn.q_proj": (D, N, H),
                p + "self_attn.k_proj": (D, K, H),
                p + "self_attn.v_proj": (D, K, H),
                p + "self_attn.o_proj": (N, H, D),
                p + "self_attn.q_norm.weight": (H,),
                p + "self_attn.k_norm.weight": (H,),
                p + "mlp.gate_proj": (D, F),
                p + "mlp.up_proj": (D, F),
                p + "mlp.down_proj": (F, D),
            }
        )
    return shapes


def _rules(config: DrafterConfig):
    yield from _GLOBAL_RULES
    for i in range(config.num_layers):
        for r in _LAYER_RULES:
            yield Rule(r.ours.format(i=i), r.hf.format(i=i), r.layout, r.n_in)


def _hf_shape(rule: Rule, ours: tuple[int, ...]) -> tuple[int, ...]:
    if rule.layout == "copy":
        return ours
    return (math.prod(ours[rule.n_in :]), math.prod(ours[: rule.n_in]))


def hf_to_params(state: dict[str, np.ndarray], config: DrafterConfig) -> dict:
    """HF-named tensors -> our nested pure dict (numpy). Strict key and shape accounting."""
    shapes = param_shapes(config)
    flat, used = {}, set()
    missing = []
    for rule in _rules(config):
        if rule.hf not in state:
            missing.append(rule.hf)
            continue
        x = np.asarray(state[rule.hf])
        want = _hf_shape(rule, shapes[rule.ours])
        if tuple(x.shape) != want:
            raise ValueError(f"z-lab drafter: {rule.hf} has shape {tuple(x.shape)}, expected {want}")
        flat[rule.ours] = x if rule.layout == "copy" else x.T.reshape(shapes[rule.ours])
        used.add(rule.hf)
    if missing:
        raise ValueError(f"z-lab drafter: missing keys {missing}")
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise ValueError(f"z-lab drafter: unexpected keys {unexpected}")
    return unflatten(flat)


def params_to_hf(params: dict, config: DrafterConfig, dtype=None) -> dict[str, np.ndarray]:
    """Our nested pure dict -> HF-named numpy tensors (``dtype``: e.g. ml_dtypes.bfloat16)."""
    flat = flatten(params)
    shapes = param_shapes(config)
    out, used = {}, set()
    for rule in _rules(config):
        if rule.ours not in flat:
            raise ValueError(f"drafter params: missing {rule.ours}")
        x = np.asarray(flat[rule.ours])
        if tuple(x.shape) != shapes[rule.ours]:
            raise ValueError(f"drafter params: {rule.ours} has shape {x.shape}, expected {shapes[rule.ours]}")
        if rule.layout == "linear":
            x = x.reshape(math.prod(x.shape[: rule.n_in]), -1).T
        out[rule.hf] = np.ascontiguousarray(x if dtype is None else x.astype(dtype))
        used.add(rule.ours)
    unexpected = sorted(set(flat) - used)
    if unexpected:
        raise ValueError(f"drafter params: unexpected entries {unexpected}")
    return out


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def unflatten(flat: dict) -> dict:
    """Dotted paths -> nested dict; all-digit parts become ints (nnx.List indices)."""
    out: dict = {}
    for path, v in flat.items():
        node = out
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


# ------------------------------------------------------------------------------------------
# Directories
# ------------------------------------------------------------------------------------------


def read_hf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` or of a sharded checkpoint (via its index)."""
    from safetensors.numpy import load_file

    path = Path(path)
    if (path / WEIGHTS_FILE).exists():
        return load_file(path / WEIGHTS_FILE)
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        out: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            out.update(load_file(path / shard))
        return out
    raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {path}")


def read_zlab_drafter(path: str | Path, **overrides) -> tuple[DrafterConfig, dict]:
    """z-lab drafter dir -> (DrafterConfig, our nested params as numpy). ``overrides`` set our own
    config fields (attention_impl, compute_dtype, ...)."""
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.exists():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    config = DrafterConfig.from_hf_dict(json.loads(cfg_file.read_text()), **overrides)
    return config, hf_to_params(read_hf_tensors(path), config)


def write_zlab_drafter(
    path: str | Path, config: DrafterConfig, params: dict, dtype: str = "bfloat16"
) -> Path:
    """Write a z-lab-format drafter dir (config.json + model.safetensors) loadable by
    ``dflash.model.DFlashDraftModel.from_pretrained``. ``dtype``: float32 | bfloat16 | float16."""
    import ml_dtypes
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise ValueError(f"write_zlab_drafter: unsupported dtype {dtype!r}")
    tensors = params_to_hf(params, config, np_dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(dtype=dtype), indent=2) + "\n")
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    return path
