"""Tiny random Qwen3.5 hybrid checkpoints built offline with transformers (the parity reference):
the text-only layout (Qwen3_5ForCausalLM, ``model.*``) and the vision-language one
(Qwen3_5ForConditionalGeneration, ``model.language_model.*`` + ``model.visual.*``)."""

from __future__ import annotations

from hf_fixtures import TINY_COMMON, ends, normal, randomise, uniform

TINY_HYBRID = dict(
    TINY_COMMON,
    num_hidden_layers=6,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=3,  # layers: lin lin full lin lin full
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

# Random norms, decays and gates, so a missed (1 + w), a swapped A_log/dt_bias or a wrong conv tap
# shows up (the first rule that matches a parameter draws it).
HYBRID_RULES = (
    (ends("linear_attn.norm.weight"), normal(1.0, 0.2)),
    (ends("norm.weight"), normal(0.0, 0.2)),  # zero-centred: the layer scales by (1 + w)
    (ends("dt_bias"), normal(0.0, 0.5)),
    (ends("A_log"), uniform(-2.0, 1.0)),
    (ends("conv1d.weight"), normal(0.0, 0.5)),
)


def make_hybrid_model(layout: str = "text", seed: int = 0, **overrides):
    """layout: text (Qwen3_5ForCausalLM) | vl (Qwen3_5ForConditionalGeneration)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    text = {**TINY_HYBRID, **overrides}
    if layout == "text":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    elif layout == "vl":
        cfg = transformers.Qwen3_5Config(
            text_config=text, vision_config=TINY_VISION, tie_word_embeddings=text["tie_word_embeddings"]
        )
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    else:
        raise ValueError(layout)
    return randomise(model.float().eval(), HYBRID_RULES)


def text_model(model):
    """The decoder (its ``.layers``) of either layout."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner
