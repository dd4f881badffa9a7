"""Tiny random HF target checkpoints built offline with transformers (the parity reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)


def tiny_hf_config(kind: str):
    """kind: qwen3 | qwen3_tied | llama3 | qwen2."""
    import transformers

    if kind in ("qwen3", "qwen3_tied"):
        return transformers.Qwen3Config(
            **TINY_COMMON,
            head_dim=32,  # != hidden/heads, as in real Qwen3
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=kind == "qwen3_tied",
        )
    if kind == "llama3":
        return transformers.LlamaConfig(
            **TINY_COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,  # small, so a 512-token prompt crosses it
            },
            tie_word_embeddings=False,
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(
            **TINY_COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            tie_word_embeddings=False,
        )
    raise ValueError(kind)


def zlab_drafter_config(*, mask_token_id, target_layer_ids, num_target_layers, block_size, **overrides):
    """The ``transformers.Qwen3Config`` of a tiny z-lab DFlash drafter (``dflash.model.DFlashDraftModel``):
    TINY_COMMON's width with 2 layers of 4 heads of 16 and an MLP of 96, ``overrides`` on top."""
    import transformers

    base = dict(
        TINY_COMMON,
        intermediate_size=96,
        num_hidden_layers=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return transformers.Qwen3Config(
        **{**base, **overrides},
        num_target_layers=num_target_layers,
        block_size=block_size,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
    )


def make_hf_model(kind: str, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_hf_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random (not default-initialised) norms and biases, so a missed or swapped one shows up.
    return randomise(model, ((ends("norm.weight"), normal(1.0, 0.2)), (ends(".bias"), normal(0.0, 0.1))))


def ends(*suffixes):
    """A parameter rule's test: the name ends with one of ``suffixes``."""
    return lambda name, p: name.endswith(suffixes)


def normal(mean: float, std: float):
    """A parameter rule's draw: mean + std * N(0, 1), one draw per element."""

    def draw(p):
        import torch

        return mean + std * torch.randn_like(p)

    return draw


def uniform(low: float, high: float):
    def draw(p):
        import torch

        return torch.empty_like(p).uniform_(low, high)

    return draw


def randomise(model, rules):
    """Redraw the parameters of ``model`` in place by ``rules``, (matches(name, parameter), draw)
    pairs: the first rule that matches a parameter draws its new value, in the order of
    ``named_parameters`` (so one seed gives one model); an unmatched one keeps its initial value."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = next((draw for matches, draw in rules if matches(name, p)), None)
            if draw is not None:
                p.copy_(draw(p))
    return model


def save_hf_model(kind: str, directory: Path, seed: int = 0, max_shard_size=None) -> Path:
    model = make_hf_model(kind, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def tiny_target(directory: Path, kind: str = "qwen3", seed: int = 0):
    """A tiny random HF model saved to ``directory`` and loaded as our target -> (hf model, target)."""
    import dflash_jax

    model = make_hf_model(kind, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return model, dflash_jax.load_target(directory)


def prompt_ids(length: int, vocab: int, seed: int = 0, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int64)
