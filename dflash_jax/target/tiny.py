"""The ``target.path: tiny`` target: a random Qwen3-style model (or its Qwen3.5-hybrid / MoE
variants, ``target.tiny_model_type``) sized by the run config's ``tiny_*`` fields and the tokenizer's
vocabulary. Its architecture is known from the section alone, so a tiny run is planned without a
weight; ``convert.tiny_target.make_tiny_target_dir`` writes the model as an HF directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from flax import nnx

from dflash_jax.layers import RopeConfig
from dflash_jax.target.config import TargetConfig

TINY_TARGET_RECIPE = 1  # bump when the tiny model is built differently
TINY_MOE_TYPES = ("qwen3_moe", "gpt_oss", "qwen3_5_moe")


def tiny_target_key(section, vocab_size: int) -> str:
    """Everything that shapes a tiny target, as a directory name: a cached one is reused only
    when it is the same model."""
    fields = dict(
        vocab=vocab_size,
        hidden=section.tiny_hidden_size,
        layers=section.tiny_num_layers,
        seed=section.tiny_seed,
        recipe=TINY_TARGET_RECIPE,
    )
    if section.tiny_model_type in TINY_MOE_TYPES:  # (the older kinds keep their directory names)
        fields["type"] = section.tiny_model_type
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    return f"tiny_target-h{section.tiny_hidden_size}-l{section.tiny_num_layers}-v{vocab_size}-{digest}"


def _dense_config(section, vocab_size: int) -> TargetConfig:
    H = section.tiny_hidden_size
    return TargetConfig(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=H,
        intermediate_size=2 * H,
        num_layers=section.tiny_num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=H // 4,
        qk_norm=True,
        rope=RopeConfig(theta=1e6),
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def _hybrid_fields(L: int, H: int) -> dict:
    """Layers of 3 Gated DeltaNet + 1 gated attention."""
    return dict(
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=H // 4,
        linear_value_head_dim=H // 4,
        partial_rotary_factor=0.25,
    )


def _moe_fields(model_type: str, L: int, H: int) -> dict:
    """Every layer a MoE block of 8 experts, top-2: qwen3_moe; gpt_oss (sliding window 16 / full
    layers, sinks, clamped SwiGLU with biases); qwen3_5_moe (the tiny hybrid's layers with a shared
    expert)."""
    moe = dict(
        model_type=model_type,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=H,
        norm_topk_prob=model_type != "gpt_oss",
        moe_layers=tuple(range(L)),
    )
    if model_type == "gpt_oss":
        moe.update(
            intermediate_size=H,  # one width in gpt-oss's config.json: the experts'
            qk_norm=False,
            attention_bias=True,
            o_proj_bias=True,
            attention_sinks=True,
            sliding_window=16,
            swiglu_limit=7.0,
            layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)),
        )
    elif model_type == "qwen3_5_moe":
        # intermediate_size stays (no dense MLP uses it): the drafter's default width
        moe.update(**_hybrid_fields(L, H), shared_expert_intermediate_size=H)
    return moe


def tiny_model_config(section, vocab_size: int) -> TargetConfig:
    """The config the tiny model is built from."""
    dense = _dense_config(section, vocab_size)
    L, H = dense.num_layers, dense.hidden_size
    if section.tiny_model_type == "qwen3_5":
        return replace(dense, model_type="qwen3_5", **_hybrid_fields(L, H))
    if section.tiny_model_type in TINY_MOE_TYPES:
        return replace(dense, **_moe_fields(section.tiny_model_type, L, H))
    return dense


def tiny_hf_config(section, vocab_size: int) -> dict:
    """The tiny target's config.json."""
    tc = tiny_model_config(section, vocab_size)
    if section.tiny_model_type != "qwen3":
        return {**tc.to_hf_dict(), "torch_dtype": "float32"}
    H = tc.hidden_size
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": H,
        "intermediate_size": 2 * H,
        "num_hidden_layers": tc.num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": H // 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def tiny_target_config(section, vocab_size: int) -> TargetConfig:
    """The tiny target's architecture as its directory's config.json gives it (what the run
    loads), from the section alone."""
    return TargetConfig.from_hf_dict(tiny_hf_config(section, vocab_size))


def build_tiny_target(section, vocab_size: int):
    """The random tiny model (``section.tiny_seed``)."""
    from dflash_jax.target.hybrid import build_target_model  # dense, hybrid or MoE by model_type

    tc = tiny_model_config(section, vocab_size)
    model = build_target_model(tc, rngs=nnx.Rngs(section.tiny_seed))
    # Unit-scale embeddings: a trained LM's next-token distribution is peaked, and the tied
    # lm_head then gives the drafter logits it can actually separate (0.02 init is ~uniform).
    model.embed_tokens[...] = model.embed_tokens[...] * 10.0
    if section.tiny_model_type in TINY_MOE_TYPES:
        model.moe.router[...] = model.moe.router[...] * 50.0  # a router that prefers some experts
    return model
