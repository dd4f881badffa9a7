"""Tiny random HF mixture-of-experts checkpoints built offline with transformers (the parity
reference): Qwen3-MoE (both expert layouts), gpt-oss (bf16 and MXFP4-packed) and Qwen3.5-MoE."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_QWEN3_MOE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,  # the dense MLP of mlp_only_layers
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],  # layers: moe dense moe moe
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=False,
)

TINY_GPT_OSS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,  # each expert's width
    num_hidden_layers=4,  # sliding full sliding full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,  # small, so a 512-token prompt crosses it
    },
    swiglu_limit=7.0,
    tie_word_embeddings=False,
)


def _randomise(model, router_std: float = 1.0):
    """Random norms, biases, sinks and a sharp router (well-separated choices, so a tiny float
    difference cannot flip one; ties are tested on purpose elsewhere)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") or name.endswith("router.weight"):
                p.copy_(router_std * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "experts" in name and p.ndim == 3:
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):  # an O(1) residual stream, as in real models
                p.copy_(torch.randn_like(p))
    return model


def make_qwen3_moe(seed: int = 0, **overrides):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})
    return _randomise(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())


def make_gpt_oss(seed: int = 0, **overrides):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**{**TINY_GPT_OSS, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return _randomise(model)


def save_fused(model, directory: Path) -> Path:
    """transformers 5's in-memory layout (fused experts) written as is, next to config.json."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    return directory


def quantize_mxfp4(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 (blocks, scales) shaped for a dequantised [E, in, out] tensor like ``w``
    (its values are not a quantisation of w: only the format matters)."""
    from convert.mxfp4 import packed_shapes

    blocks_shape, scales_shape = packed_shapes(w.shape)
    blocks = rng.integers(0, 256, blocks_shape, dtype=np.uint8)
    scales = rng.integers(119, 122, scales_shape, dtype=np.uint8)  # 2**-8 .. 2**-6: O(0.1) weights
    return blocks, scales


def qwen3_5_moe_text_config(**overrides) -> dict:
    from hybrid_fixtures import TINY_HYBRID

    text = {k: v for k, v in TINY_HYBRID.items() if k != "intermediate_size"}
    return {
        **text,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        **overrides,
    }


def make_qwen3_5_moe(layout: str = "text", seed: int = 0, **overrides):
    """layout: text (Qwen3_5MoeForCausalLM) | vl (Qwen3_5MoeForConditionalGeneration)."""
    import torch
    import transformers
    from hybrid_fixtures import TINY_VISION

    torch.manual_seed(seed)
    text = qwen3_5_moe_text_config(**overrides)
    if layout == "text":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    else:
        cfg = transformers.Qwen3_5MoeConfig(
            text_config=text, vision_config=TINY_VISION, tie_word_embeddings=False
        )
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    model = model.float().eval()
    with torch.no_grad():  # as hybrid_fixtures (zero-centred norms), plus a sharp router
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
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
            elif "experts" in name and p.ndim == 3:
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
    return model
