"""HF <-> dflash-jax weight mapping for target LLMs (Llama, Qwen2, Qwen3, Qwen3.5), as ``KeyRule``
data (``convert.hf_mapping``); our layer parameters are stacked (leading layer dimension).

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

from convert.hf_mapping import KeyRule, check_tensors, entries, hf_shape, to_hf, to_ours
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


def hybrid_key_map(config: TargetConfig, prefix: str = "model.") -> list[KeyRule]:
    L = prefix + "layers.{i}."
    full, lin = config.full_attention_layers, config.linear_attention_layers
    rules = [
        KeyRule("embed_tokens", prefix + "embed_tokens.weight", "copy"),
        KeyRule("norm", prefix + "norm.weight", "vector"),
        KeyRule("layers.input_norm", L + "input_layernorm.weight", "vector"),
        KeyRule("layers.post_norm", L + "post_attention_layernorm.weight", "vector"),
        KeyRule("layers.gate", L + "mlp.gate_proj.weight", "linear"),
        KeyRule("layers.up", L + "mlp.up_proj.weight", "linear"),
        KeyRule("layers.down", L + "mlp.down_proj.weight", "linear"),
    ]
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


def target_key_map(config: TargetConfig, prefix: str = "model.") -> list[KeyRule]:
    if config.is_hybrid:
        return hybrid_key_map(config, prefix)
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
        KeyRule("layers.gate", L + "mlp.gate_proj.weight", "linear"),
        KeyRule("layers.up", L + "mlp.up_proj.weight", "linear"),
        KeyRule("layers.down", L + "mlp.down_proj.weight", "linear"),
    ]
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
    rules = target_key_map(config, checkpoint_prefix(config, reader.keys()))
    expected: dict[str, tuple[int, ...]] = {}
    for rule, ours, hf, layer in entries(rules, config.num_layers):
        if ours not in variables:
            raise KeyError(f"internal: key map names {ours!r}, which the model does not have")
        shape = tuple(variables[ours].shape)
        expected[hf] = hf_shape(rule, shape[1:] if layer is not None else shape)
    present = {k: tuple(reader.shape(k)) for k in reader.keys()}
    ignorable = {k for k in present if k.endswith(_IGNORABLE_SUFFIXES)}
    if config.is_hybrid:
        skipped = {k for k in present if k.startswith(HYBRID_SKIPPED_PREFIXES)}
        if skipped:
            log.info("skipping %d vision / MTP tensors (%s)", len(skipped), ", ".join(HYBRID_SKIPPED_PREFIXES))
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
        layers = rule.layer_indices(config.num_layers) if rule.stacked else ()
        for name in [rule.hf.format(i=i) for i in layers] if rule.stacked else [rule.hf]:
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
                host = to_ours(rule, reader.get(rule.hf.format(i=i)), per_shape).astype(dtype)
                parts.append(put_global(host, per_sharding))
            value = _stack(parts, sharding)
        else:
            host = to_ours(rule, reader.get(rule.hf), shape).astype(dtype)
            value = put_global(host, sharding)
        var.set_value(value)
        if progress:
            progress(rule.ours)
    return nnx.merge(graphdef, state)


def _stack(parts: list[jax.Array], sharding: NamedSharding) -> jax.Array:
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*parts)


def export_target_state(model: nnx.Module) -> dict[str, np.ndarray]:
    """Our target params -> HF-named numpy tensors (the inverse direction, for tests and tools)."""
    config: TargetConfig = model.config
    variables = _state_index(nnx.state(model))
    out = {}
    for rule in target_key_map(config):
        value = np.asarray(jax.device_get(variables[rule.ours][...]))
        if rule.stacked:
            for row, i in enumerate(rule.layer_indices(config.num_layers)):
                out[rule.hf.format(i=i)] = to_hf(rule, value[row])
        else:
            out[rule.hf] = to_hf(rule, value)
    return out
