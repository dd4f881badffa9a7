"""Batched autoregressive generation with the target's KV cache (greedy or sampled), all in JAX.

Used to regenerate training responses with the target itself and as the plain-decoding baseline
of the evaluator. Prompts of different lengths are right-padded to a bucketed length; each row's
cache length is then set to its own prompt length, so padding is never attended to.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


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


def bucket_length(n: int, multiple: int = 64) -> int:
    """Round a length up to a multiple, so a few compiled shapes serve all prompts."""
    return max(multiple, -(-n // multiple) * multiple)


def pad_prompts(prompts, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into ``[rows, bucket_length(longest)]`` ids plus their lengths
    (rows past the prompts are dummies of length 1)."""
    P = bucket_length(max(len(p) for p in prompts))
    ids = np.zeros((rows, P), np.int32)
    lengths = np.ones((rows,), np.int32)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = p
        lengths[r] = len(p)
    return ids, lengths


@partial(nnx.jit, static_argnames=("max_new_tokens", "sampling"))
def _generate_batch(target, ids, lengths, eos_ids, key, *, max_new_tokens: int, sampling: SamplingConfig):
    B, P = ids.shape
    cache = target.init_cache(B, P + max_new_tokens)
    out = target(ids, cache=cache, return_logits=False)
    cache = out.cache.with_lengths(lengths)
    last_hidden = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    first = pick_token(target.logits(last_hidden), sampling, sub)
    tokens = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids)
    n_out = jnp.ones((B,), jnp.int32)

    def cond(state):
        step, _, _, done, _, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, tokens, cache, done, n_out, key = state
        prev = tokens[:, step - 1]
        o = target(prev[:, None], cache=cache)
        key, sub = jax.random.split(key)
        nxt = pick_token(o.logits[:, 0], sampling, sub)
        nxt = jnp.where(done, 0, nxt)
        tokens = tokens.at[:, step].set(nxt)
        n_out = n_out + (~done).astype(jnp.int32)
        done = done | jnp.isin(nxt, eos_ids)
        return step + 1, tokens, o.cache.commit(), done, n_out, key

    _, tokens, _, _, n_out, _ = jax.lax.while_loop(cond, body, (1, tokens, cache, done, n_out, key))
    return tokens, n_out


def generate(
    target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...] | list[int] = (),
    sampling: SamplingConfig | None = None,
    batch_size: int = 8,
    seed: int = 0,
    progress=None,
) -> list[list[int]]:
    """Generate a continuation for each prompt (token id lists). Each output stops after its first
    EOS (included) or at ``max_new_tokens``. ``progress(n)`` is called after each batch."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = sampling or SamplingConfig()
    eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
    key = jax.random.key(seed)
    results: list[list[int]] = [None] * len(prompts)  # type: ignore[list-item]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths together
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = [prompts[i] for i in idx]
        if any(len(p) == 0 for p in batch):
            raise ValueError("generate: empty prompt")
        ids, lengths = pad_prompts(batch, batch_size)
        key, sub = jax.random.split(key)
        tokens, n_out = _generate_batch(
            target,
            jnp.asarray(ids),
            jnp.asarray(lengths),
            eos,
            sub,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
        )
        tokens, n_out = np.asarray(tokens), np.asarray(n_out)
        for r, i in enumerate(idx):
            results[i] = tokens[r, : n_out[r]].tolist()
        if progress is not None:
            progress(len(idx))
    return results
