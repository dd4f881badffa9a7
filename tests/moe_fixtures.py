"""Tiny random HF mixture-of-experts checkpoints built offline with transformers (the parity
reference): Qwen3-MoE (both expert layouts), gpt-oss (bf16 and MXFP4-packed) and Qwen3.5-MoE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hf_fixtures import TINY_COMMON, ends, normal, randomise
from hybrid_fixtures import HYBRID_RULES, TINY_HYBRID, TINY_VISION

TINY_QWEN3_MOE = dict(
    TINY_COMMON,
    intermediate_size=96,  # the dense MLP of mlp_only_layers
    moe_intermediate_size=32,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],  # layers: moe dense moe moe
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=False,
)

TINY_GPT_OSS = dict(
    TINY_COMMON,  # 4 layers: sliding full sliding full
    intermediate_size=32,  # each expert's width
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=128,
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


# A sharp router (well-separated choices, so a tiny float difference cannot flip one; ties are
# tested on purpose elsewhere), experts of O(0.1) and an O(1) residual stream, as in real models.
MOE_RULES = (
    (ends("mlp.gate.weight", "router.weight"), normal(0.0, 1.0)),
    (lambda n, p: "experts" in n and p.ndim == 3, normal(0.0, 0.1)),
    (ends("embed_tokens.weight"), normal(0.0, 1.0)),
)
# Random norms, biases and sinks besides.
QWEN3_MOE_RULES = (
    (ends("norm.weight"), normal(1.0, 0.2)),
    MOE_RULES[0],
    (ends("bias", "sinks"), normal(0.0, 0.5)),
    *MOE_RULES[1:],
)


def make_qwen3_moe(seed: int = 0, **overrides):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})
    return randomise(
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), QWEN3_MOE_RULES
    )


def make_gpt_oss(seed: int = 0, **overrides):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**{**TINY_GPT_OSS, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return randomise(model, QWEN3_MOE_RULES)


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

    torch.manual_seed(seed)
    text = qwen3_5_moe_text_config(**overrides)
    if layout == "text":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    else:
        cfg = transformers.Qwen3_5MoeConfig(
            text_config=text, vision_config=TINY_VISION, tie_word_embeddings=False
        )
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    # As the dense hybrid (zero-centred norms), plus the MoE's router, experts and embeddings.
    return randomise(model.float().eval(), (*HYBRID_RULES, *MOE_RULES))
