"""HF <-> dflash-jax weight mapping for target LLMs (Llama, Qwen2, Qwen3), as data.

Each ``KeyRule`` ties one of our parameters to an HF key (``{i}`` = layer index for stacked
parameters) with a layout kind that defines both directions:

  linear: HF stores ``[out, in]``; we store ``[*in_dims, *out_dims]`` (named einsum layout).
          ours = hf.T.reshape(our_shape);  hf = ours.reshape(hf_shape[::-1]).T
  vector: flattened in HF (norm weights, biases: ours may split heads, e.g. [N, H]).
  copy:   the same shape on both sides (embeddings).
  conv:   HF depthwise Conv1d weight ``[C, 1, W]``; ours ``[C, W]``.

Qwen3.5 hybrids: ``layers`` on a rule lists the HF layer indices its stacked rows come from (the
full- or linear-attention layers); the text weights sit under ``model.`` (Qwen3_5ForCausalLM) or
``model.language_model.`` (the vision-language checkpoint), and the vision tower (``model.visual.*``)
and multi-token-prediction head (``mtp.*``) are skipped by an explicit rule.

Loading is strict: every expected key must exist with the expected shape and nothing else may be
in the checkpoint; each tensor goes straight from a memory-mapped file onto its mesh sharding.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from convert.safetensors_io import CheckpointReader
from dflash_jax.sharding import named_sharding
from dflash_jax.target.config import TargetConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyRule:
    ours: str  # dotted path in the NNX state, e.g. "layers.q"
    hf: str  # HF key; "{i}" is the layer index for stacked params
    kind: str  # "linear" | "vector" | "copy" | "conv"
    in_dims: int = 1  # linear only: how many leading dims of ours are the input side
    layers: tuple[int, ...] | None = None  # stacked: HF layer index of each row (None: 0..L-1)

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    def layer_indices(self, config: TargetConfig) -> tuple[int, ...]:
        return tuple(range(config.num_layers)) if self.layers is None else self.layers


# Keys some HF checkpoints carry that hold no weights we need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


# Qwen3.5 checkpoint parts we do not use, skipped by name (never silently).
HYBRID_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
VL_TEXT_PREFIX = "model.language_model."


def checkpoint_prefix(config: TargetConfig, keys) -> str:
    """Where the text model's weights sit: ``model.`` or, for Qwen3.5 VL checkpoints,
    ``model.language_model.``."""
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
    rules += [
        KeyRule("attn.q", A + "q_proj.weight", "linear", layers=full),
        KeyRule("attn.k", A + "k_proj.weight", "linear", layers=full),
        KeyRule("attn.v", A + "v_proj.weight", "linear", layers=full),
        KeyRule("attn.o", A + "o_proj.weight", "linear", in_dims=2, layers=full),
        KeyRule("attn.q_norm", A + "q_norm.weight", "vector", layers=full),
        KeyRule("attn.k_norm", A + "k_norm.weight", "vector", layers=full),
        KeyRule("gdn.in_qkv", G + "in_proj_qkv.weight", "linear", layers=lin),
        KeyRule("gdn.in_z", G + "in_proj_z.weight", "linear", layers=lin),
        KeyRule("gdn.in_b", G + "in_proj_b.weight", "linear", layers=lin),
        KeyRule("gdn.in_a", G + "in_proj_a.weight", "linear", layers=lin),
        KeyRule("gdn.conv", G + "conv1d.weight", "conv", layers=lin),
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


def hf_shape(rule: KeyRule, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape for one (unstacked) parameter of ours."""
    if rule.kind == "copy":
        return tuple(our_shape)
    if rule.kind == "conv":
        return (our_shape[0], 1, our_shape[1])
    if rule.kind == "vector":
        return (math.prod(our_shape),)
    ins, outs = our_shape[: rule.in_dims], our_shape[rule.in_dims :]
    return (math.prod(outs), math.prod(ins))


def to_ours(rule: KeyRule, hf_array: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
    if rule.kind == "linear":
        return np.ascontiguousarray(hf_array.T).reshape(our_shape)
    return hf_array.reshape(our_shape)


def to_hf(rule: KeyRule, ours: np.ndarray) -> np.ndarray:
    shape = hf_shape(rule, ours.shape)
    if rule.kind == "linear":
        return np.ascontiguousarray(ours.reshape(shape[::-1]).T)
    return ours.reshape(shape)


def _state_index(state: nnx.State) -> dict[str, nnx.Variable]:
    return {".".join(str(p) for p in path): var for path, var in state.flat_state()}


def check_checkpoint(reader: CheckpointReader, config: TargetConfig, variables: dict[str, nnx.Variable]):
    """Strict key accounting before any tensor is read: raises naming every problem found."""
    rules = target_key_map(config, checkpoint_prefix(config, reader.keys()))
    expected: dict[str, tuple[int, ...]] = {}
    for rule in rules:
        if rule.ours not in variables:
            raise KeyError(f"internal: key map names {rule.ours!r}, which the model does not have")
        shape = tuple(variables[rule.ours].shape)
        per = shape[1:] if rule.stacked else shape
        want = hf_shape(rule, per)
        for i in rule.layer_indices(config) if rule.stacked else [None]:
            expected[rule.hf.format(i=i)] = want
    present = set(reader.keys())
    missing = sorted(set(expected) - present)
    ignorable = {k for k in present if k.endswith(_IGNORABLE_SUFFIXES)}
    if config.is_hybrid:
        skipped = {k for k in present if k.startswith(HYBRID_SKIPPED_PREFIXES)}
        if skipped:
            log.info("skipping %d vision / MTP tensors (%s)", len(skipped), ", ".join(HYBRID_SKIPPED_PREFIXES))
        ignorable |= skipped
    if config.tie_word_embeddings and "lm_head.weight" in present:
        ignorable.add("lm_head.weight")  # some exports keep the tied copy; it must equal embed_tokens
    unexpected = sorted(present - set(expected) - ignorable)
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(
            f"unexpected tensors: {', '.join(unexpected[:20])}" + (" ..." if len(unexpected) > 20 else "")
        )
    for key, want in expected.items():
        if key in present and tuple(reader.shape(key)) != want:
            problems.append(f"tensor {key!r} has shape {tuple(reader.shape(key))}, expected {want}")
    if problems:
        raise ValueError(
            f"checkpoint {reader.directory} does not match its config.json: " + "; ".join(problems)
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

    for rule in rules:
        var = variables[rule.ours]
        shape = tuple(var.shape)
        sharding = named_sharding(mesh, var.get_metadata().get("logical_axes"), shape)
        if rule.stacked:
            per_shape = shape[1:]
            per_sharding = NamedSharding(mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
            parts = []
            for i in rule.layer_indices(config):
                host = to_ours(rule, reader.get(rule.hf.format(i=i)), per_shape).astype(dtype)
                parts.append(jax.device_put(host, per_sharding))
            value = _stack(parts, sharding)
        else:
            host = to_ours(rule, reader.get(rule.hf), shape).astype(dtype)
            value = jax.device_put(host, sharding)
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
            for row, i in enumerate(rule.layer_indices(config)):
                out[rule.hf.format(i=i)] = to_hf(rule, value[row])
        else:
            out[rule.hf] = to_hf(rule, value)
    return out
