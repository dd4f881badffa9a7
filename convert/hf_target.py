"""HF <-> dflash-jax weight mapping for target LLMs (Llama, Qwen2, Qwen3, Qwen3.5, Qwen3-MoE,
Qwen3.5-MoE, gpt-oss), as ``KeyRule`` data (``convert.hf_mapping``); our layer parameters are
stacked (leading layer dimension).

MoE experts come in the layouts HF has (picked by the keys present, ``expert_layout``): Qwen's
published per-expert tensors (``mlp.experts.{e}.gate_proj.weight``, what ``save_pretrained``
writes) or transformers 5's fused in-memory ones (``mlp.experts.gate_up_proj`` [E, 2F, D],
``down_proj`` [E, D, F]); gpt-oss's fused [E, in, out] tensors (gate and up interleaved) in bf16
or MXFP4-packed (``*_blocks`` + ``*_scales``, dequantised at load).

Qwen3.5 hybrids: ``attn.*`` / ``gdn.*`` rows come from the full- / linear-attention layers (the
rules' ``layers``); the text weights sit under ``model.`` (Qwen3_5ForCausalLM) or
``model.language_model.`` (the vision-language checkpoint, picked by the keys present), and the
vision tower (``model.visual.*``) and multi-token-prediction head (``mtp.*``) are skipped by an
explicit rule, logged, never silently.

Loading is strict: every expected key must exist with the expected shape and nothing else may be
in the checkpoint; each tensor goes straight from a memory-mapped file onto its mesh sharding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from convert.hf_mapping import (
    KeyRule,
    check_tensors,
    entries,
    layer_name,
    merge_part,
    read_ours,
    source_shapes,
    to_hf,
    to_hf_experts,
)
from convert.safetensors_io import CheckpointReader, CorruptCheckpointError
from dflash_jax.sharding import named_sharding, put_global
from dflash_jax.target.config import TargetConfig, qkv_channel_order

log = logging.getLogger(__name__)


# Keys some HF checkpoints carry that hold no weights we need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


# Qwen3.5 checkpoint parts we do not use, skipped by name.
HYBRID_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
VL_TEXT_PREFIX = "model.language_model."


def checkpoint_prefix(config: TargetConfig, keys) -> str:
    """Where the text model's weights sit: ``model.`` or (Qwen3.5 VL) ``model.language_model.``."""
    if config.is_hybrid and any(k.startswith(VL_TEXT_PREFIX) for k in keys):
        return VL_TEXT_PREFIX
    return "model."


EXPERT_LAYOUTS = ("per_expert", "fused", "mxfp4")


def expert_layout(config: TargetConfig, keys) -> str | None:
    """Which expert layout a checkpoint (its tensor names) uses; None for dense targets."""
    if not config.is_moe:
        return None
    keys = list(keys)
    if config.model_type == "gpt_oss":
        return "mxfp4" if any(k.endswith("mlp.experts.gate_up_proj_blocks") for k in keys) else "fused"
    return "fused" if any(k.endswith("mlp.experts.gate_up_proj") for k in keys) else "per_expert"


def default_expert_layout(config: TargetConfig) -> str | None:
    """The layout transformers' ``save_pretrained`` writes (export's default)."""
    if not config.is_moe:
        return None
    return "fused" if config.model_type == "gpt_oss" else "per_expert"


def moe_rules(config: TargetConfig, L: str, layout: str) -> list[KeyRule]:
    """The MoE block's rules; L is the HF layer prefix (with ``{i}``)."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert layout {layout!r}; one of {EXPERT_LAYOUTS}")
    E, layers, X = config.num_experts, config.moe_layers, L + "mlp.experts."
    if config.model_type == "gpt_oss":
        q = "mxfp4" if layout == "mxfp4" else None
        two = dict(layers=layers, interleaved=True)
        return [
            KeyRule("moe.router", L + "mlp.router.weight", "linear", layers=layers),
            KeyRule("moe.router_bias", L + "mlp.router.bias", "vector", layers=layers),
            KeyRule("moe.gate", X + "gate_up_proj", "experts_io", part=(0, 2), quant=q, **two),
            KeyRule("moe.up", X + "gate_up_proj", "experts_io", part=(1, 2), quant=q, **two),
            KeyRule("moe.down", X + "down_proj", "experts_io", layers=layers, quant=q),
            KeyRule("moe.gate_bias", X + "gate_up_proj_bias", "expert_vector", part=(0, 2), **two),
            KeyRule("moe.up_bias", X + "gate_up_proj_bias", "expert_vector", part=(1, 2), **two),
            KeyRule("moe.down_bias", X + "down_proj_bias", "expert_vector", layers=layers),
        ]
    if layout == "mxfp4":
        raise ValueError(f"{config.model_type}: MXFP4-packed experts exist only for gpt_oss")
    rules = [KeyRule("moe.router", L + "mlp.gate.weight", "linear", layers=layers)]
    if layout == "per_expert":
        rules += [
            KeyRule(f"moe.{p}", X + "{e}." + f"{p}_proj.weight", "linear", layers=layers, experts=E)
            for p in ("gate", "up", "down")
        ]
    else:
        rules += [
            KeyRule("moe.gate", X + "gate_up_proj", "experts", layers=layers, part=(0, 2)),
            KeyRule("moe.up", X + "gate_up_proj", "experts", layers=layers, part=(1, 2)),
            KeyRule("moe.down", X + "down_proj", "experts", layers=layers),
        ]
    if config.shared_expert_intermediate_size:
        S = L + "mlp.shared_expert."
        rules += [
            KeyRule(f"moe.shared_{p}", S + f"{p}_proj.weight", "linear", layers=layers)
            for p in ("gate", "up", "down")
        ]
        rules.append(
            KeyRule("moe.shared_expert_gate", L + "mlp.shared_expert_gate.weight", "linear", layers=layers)
        )
    return rules


def dense_mlp_rules(config: TargetConfig, L: str) -> list[KeyRule]:
    """The dense SwiGLU MLP rules: ``layers.*`` on a dense target, ``mlp.*`` (its dense layers
    only) on a MoE one."""
    group, layers = ("mlp", config.dense_mlp_layers) if config.is_moe else ("layers", None)
    return [
        KeyRule(f"{group}.{p}", L + f"mlp.{p}_proj.weight", "linear", layers=layers)
        for p in ("gate", "up", "down")
    ]


def hybrid_key_map(config: TargetConfig, prefix: str = "model.", layout: str | None = None) -> list[KeyRule]:
    L = prefix + "layers.{i}."
    full, lin = config.full_attention_layers, config.linear_attention_layers
    rules = [
        KeyRule("embed_tokens", prefix + "embed_tokens.weight", "copy"),
        KeyRule("norm", prefix + "norm.weight", "vector"),
        KeyRule("layers.input_norm", L + "input_layernorm.weight", "vector"),
        KeyRule("layers.post_norm", L + "post_attention_layernorm.weight", "vector"),
    ]
    rules += moe_rules(config, L, layout or "per_expert") if config.is_moe else dense_mlp_rules(config, L)
    if not config.tie_word_embeddings:
        rules.append(KeyRule("lm_head", "lm_head.weight", "linear"))
    A, G = L + "self_attn.", L + "linear_attn."
    qkv = qkv_channel_order(config) if lin else None  # q|k|v channels grouped by key head
    rules += [
        KeyRule("attn.q", A + "q_proj.weight", "linear", layers=full),  # per head [query ; gate]
        KeyRule("attn.k", A + "k_proj.weight", "linear", layers=full),
        KeyRule("attn.v", A + "v_proj.weight", "linear", layers=full),
        KeyRule("attn.o", A + "o_proj.weight", "linear", in_dims=2, layers=full),
        KeyRule("attn.q_norm", A + "q_norm.weight", "vector", layers=full),
        KeyRule("attn.k_norm", A + "k_norm.weight", "vector", layers=full),
        KeyRule("gdn.in_qkv", G + "in_proj_qkv.weight", "linear", layers=lin, rows=qkv),
        KeyRule("gdn.in_z", G + "in_proj_z.weight", "linear", layers=lin),
        KeyRule("gdn.in_b", G + "in_proj_b.weight", "linear", layers=lin),
        KeyRule("gdn.in_a", G + "in_proj_a.weight", "linear", layers=lin),
        KeyRule("gdn.conv", G + "conv1d.weight", "conv", layers=lin, rows=qkv),
        KeyRule("gdn.dt_bias", G + "dt_bias", "vector", layers=lin),
        KeyRule("gdn.A_log", G + "A_log", "vector", layers=lin),
        KeyRule("gdn.norm", G + "norm.weight", "vector", layers=lin),
        KeyRule("gdn.out", G + "out_proj.weight", "linear", in_dims=2, layers=lin),
    ]
    return [r for r in rules if r.layers is None or r.layers]


def target_key_map(config: TargetConfig, prefix: str = "model.", layout: str | None = None) -> list[KeyRule]:
    """Every rule of ``config``'s checkpoint; ``layout``: the expert layout of a MoE target
    (``expert_layout`` of the checkpoint; default what transformers writes)."""
    layout = layout or default_expert_layout(config)
    if config.is_hybrid:
        return hybrid_key_map(config, prefix, layout)
    L = "model.layers.{i}."
    rules = [
        KeyRule("embed_tokens", "model.embed_tokens.weight", "copy"),
        KeyRule("norm", "model.norm.weight", "vector"),
        KeyRule("layers.input_norm", L + "input_layernorm.weight", "vector"),
        KeyRule("layers.post_norm", L + "post_attention_layernorm.weight", "vector"),
        KeyRule("layers.q", L + "self_attn.q_proj.weight", "linear"),
        KeyRule("layers.k", L + "self_attn.k_proj.weight", "linear"),
        KeyRule("layers.v", L + "self_attn.v_proj.weight", "linear"),
        KeyRule("layers.o", L + "self_attn.o_proj.weight", "linear", in_dims=2),
    ]
    if config.is_moe:
        rules += moe_rules(config, L, layout)
    if config.dense_mlp_layers:
        rules += dense_mlp_rules(config, L)
    if config.attention_sinks:
        rules.append(KeyRule("layers.sinks", L + "self_attn.sinks", "vector"))
    if not config.tie_word_embeddings:
        rules.append(KeyRule("lm_head", "lm_head.weight", "linear"))
    if config.attention_bias:
        rules += [
            KeyRule(f"layers.{p}_bias", L + f"self_attn.{p}_proj.bias", "vector") for p in ("q", "k", "v")
        ]
    if config.o_proj_bias:
        rules.append(KeyRule("layers.o_bias", L + "self_attn.o_proj.bias", "vector"))
    if config.mlp_bias:
        rules += [
            KeyRule(f"layers.{p}_bias", L + f"mlp.{p}_proj.bias", "vector") for p in ("gate", "up", "down")
        ]
    if config.qk_norm:
        rules += [
            KeyRule("layers.q_norm", L + "self_attn.q_norm.weight", "vector"),
            KeyRule("layers.k_norm", L + "self_attn.k_norm.weight", "vector"),
        ]
    return rules


def _state_index(state: nnx.State) -> dict[str, nnx.Variable]:
    return {".".join(str(p) for p in path): var for path, var in state.flat_state()}


def check_checkpoint(reader: CheckpointReader, config: TargetConfig, variables: dict[str, nnx.Variable]):
    """Strict key accounting before any tensor is read: raises naming every problem found."""
    keys = reader.keys()
    rules = target_key_map(config, checkpoint_prefix(config, keys), expert_layout(config, keys))
    expected: dict[str, tuple[int, ...]] = {}
    for rule, ours, hf, layer in entries(rules, config.num_layers):
        if ours not in variables:
            raise KeyError(f"internal: key map names {ours!r}, which the model does not have")
        shape = tuple(variables[ours].shape)
        expected.update(source_shapes(rule, hf, shape[1:] if layer is not None else shape))
    present = {k: tuple(reader.shape(k)) for k in reader.keys()}
    ignorable = {k for k in present if k.endswith(_IGNORABLE_SUFFIXES)}
    if config.is_hybrid:
        skipped = {k for k in present if k.startswith(HYBRID_SKIPPED_PREFIXES)}
        if skipped:
            log.info(
                "skipping %d vision / MTP tensors (%s)", len(skipped), ", ".join(HYBRID_SKIPPED_PREFIXES)
            )
        ignorable |= skipped
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some exports keep the tied copy; it must equal embed_tokens
    check_tensors(
        f"checkpoint {reader.directory} does not match its config.json", expected, present, ignorable
    )
    return rules


def load_weights_into(
    abstract_model: nnx.Module,
    reader: CheckpointReader,
    config: TargetConfig,
    mesh: Mesh,
    dtype,
    progress: Callable[[str], None] | None = None,
) -> nnx.Module:
    """Fill an ``nnx.eval_shape``-built model from the checkpoint, one tensor at a time onto the mesh."""
    graphdef, state = nnx.split(abstract_model)
    variables = _state_index(state)
    rules = check_checkpoint(reader, config, variables)
    covered = {r.ours for r in rules}
    left = sorted(set(variables) - covered)
    if left:
        raise KeyError(f"internal: parameters without an HF key rule: {left}")
    for rule in rules:  # before any tensor is placed: an integer weight would be cast silently
        if rule.quant is not None:  # packed (MXFP4 uint8 blocks + scales), dequantised on read
            continue
        layers = rule.layer_indices(config.num_layers) if rule.stacked else ()
        names = [layer_name(rule, i) for i in layers] if rule.stacked else [rule.hf]
        if rule.experts:  # one tensor per expert
            names = [n.replace("{e}", str(e)) for n in names for e in range(rule.experts)]
        for name in names:
            stored = reader.dtype(name)
            if stored.kind in "biu":
                raise CorruptCheckpointError(
                    f"checkpoint {reader.directory}: tensor {name!r} is stored as {stored.name}, which "
                    "cannot hold model weights (expected a floating dtype: F32, BF16, F16, F8)"
                )

    for rule in rules:
        var = variables[rule.ours]
        shape = tuple(var.shape)
        sharding = named_sharding(mesh, var.get_metadata().get("logical_axes"), shape)
        if rule.stacked:
            per_shape = shape[1:]
            per_sharding = NamedSharding(mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
            parts = []
            for i in rule.layer_indices(config.num_layers):
                host = read_ours(rule, reader.get, layer_name(rule, i), per_shape).astype(dtype)
                parts.append(put_global(host, per_sharding))
            value = _stack(parts, sharding)
        else:
            host = read_ours(rule, reader.get, rule.hf, shape).astype(dtype)
            value = put_global(host, sharding)
        var.set_value(value)
        if progress:
            progress(rule.ours)
    return nnx.merge(graphdef, state)


def _stack(parts: list[jax.Array], sharding: NamedSharding) -> jax.Array:
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*parts)


def export_target_state(model: nnx.Module, layout: str | None = None) -> dict[str, np.ndarray]:
    """Our target params -> HF-named numpy tensors (the inverse direction, for tests and tools);
    ``layout``: a MoE target's expert layout (default: what transformers writes; not mxfp4)."""
    config: TargetConfig = model.config
    if layout == "mxfp4":
        raise ValueError("export_target_state: experts are exported unquantised (layout 'fused')")
    variables = _state_index(nnx.state(model))
    out: dict[str, np.ndarray] = {}

    def put(rule, name, value):
        if rule.experts:
            out.update(to_hf_experts(rule, name, value))
        else:
            out[name] = merge_part(rule, out.get(name), to_hf(rule, value))

    for rule in target_key_map(config, layout=layout):
        value = np.asarray(jax.device_get(variables[rule.ours][...]))
        if rule.stacked:
            for row, i in enumerate(rule.layer_indices(config.num_layers)):
                put(rule, layer_name(rule, i), value[row])
        else:
            put(rule, rule.hf, value)
    return out
