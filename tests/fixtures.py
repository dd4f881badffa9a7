"""Test doubles shared by several test files: duck-typed stub targets and their configs, and the
tiny dense target config built without a checkpoint."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np

from dflash_jax.layers import RopeConfig


def stub_target_config(**overrides) -> types.SimpleNamespace:
    """A target config with the fields a drafter reads (``DrafterConfig.for_target``, ``check_target``)."""
    base = dict(
        model_type="qwen3",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=160,
        num_layers=36,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=1e6),
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


def tiny_target_config(**overrides):
    """A tiny Qwen3-style ``TargetConfig`` for models built in memory (no files, no torch):
    D=32, 4 query and 2 KV heads of 8, MLP 64, 3 layers, V=256."""
    from dflash_jax.target.config import TargetConfig

    base = dict(
        model_type="qwen3",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
    )
    return TargetConfig(**{**base, **overrides})


class StubTarget:
    """The duck-typed target interface the drafter relies on: config, embed, lm_head_weight (logits
    for callers that want the target's own)."""

    def __init__(self, config: types.SimpleNamespace, seed: int = 0):
        rng = np.random.default_rng(seed)
        V, D = config.vocab_size, config.hidden_size
        self.embed_table = jnp.asarray(rng.normal(size=(V, D)).astype(np.float32))
        self.lm_head = jnp.asarray(rng.normal(size=(D, V)).astype(np.float32) * 0.1)
        self.config = config

    def embed(self, ids):
        return self.embed_table[ids]

    def lm_head_weight(self):
        return self.lm_head

    def logits(self, hidden):
        return hidden @ self.lm_head


def read_all_records(index) -> list[dict]:
    """Every record of a data index (``data.sources.RecordSource``), in order."""
    from dflash_jax.data.sources import RecordSource

    src = RecordSource(index)
    try:
        return [src[i] for i in range(len(src))]
    finally:
        src.close()


def masked_runs(tok, ids, mask) -> list[str]:
    """Decode each maximal run of masked (trained) tokens."""
    runs, i = [], 0
    while i < len(ids):
        if mask[i]:
            j = i
            while j < len(ids) and mask[j]:
                j += 1
            runs.append(tok.decode([int(t) for t in ids[i:j]]))
            i = j
        else:
            i += 1
    return runs


def hf_ids(tok, messages, **kw) -> list[int]:
    """transformers' own chat-template token ids (a list whatever the version returns)."""
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
