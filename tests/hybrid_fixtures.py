"""Tiny random Qwen3.5 hybrid checkpoints built offline with transformers (the parity reference):
the text-only layout (Qwen3_5ForCausalLM, ``model.*``) and the vision-language one
(Qwen3_5ForConditionalGeneration, ``model.language_model.*`` + ``model.visual.*``)."""

from __future__ import annotations

from pathlib import Path

TINY_HYBRID = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=3,  # layers: lin lin full lin lin full
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


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
    model = model.float().eval()
    # Random norms, decays and gates, so a missed (1 + w), a swapped A_log/dt_bias or a wrong
    # conv tap shows up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-2.0, 1.0))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def text_model(model):
    """The decoder (its ``.layers``) of either layout."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def save_hybrid_model(directory: Path, layout: str = "text", seed: int = 0, **overrides):
    model = make_hybrid_model(layout, seed, **overrides)
    model.save_pretrained(directory, safe_serialization=True)
    return model
