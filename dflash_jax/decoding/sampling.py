"""How a token is chosen from logits: greedy, or sampled after temperature, top-k and top-p.

Shared by plain generation and speculative decoding, whose acceptance rule needs the same filtered
distributions (``sampling_logprobs``) for the target and the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sampling_logprobs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p filtering (fp32). Needs temperature > 0."""
    scores = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < scores.shape[-1]:
        kth = jax.lax.top_k(scores, cfg.top_k)[0][..., -1:]
        scores = jnp.where(scores < kth, -jnp.inf, scores)
    if cfg.top_p < 1.0:
        sorted_scores = jnp.sort(scores, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_scores, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = before < cfg.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_scores, jnp.inf), axis=-1, keepdims=True)
        scores = jnp.where(scores < cutoff, -jnp.inf, scores)
    return jax.nn.log_softmax(scores, axis=-1)


def pick_token(logits: jax.Array, cfg: SamplingConfig, key: jax.Array) -> jax.Array:
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, sampling_logprobs(logits, cfg), axis=-1).astype(jnp.int32)
