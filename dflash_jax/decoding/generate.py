"""Batched autoregressive generation with the target's KV cache (greedy or sampled), all in JAX.

Used to regenerate training responses with the target itself and as the plain-decoding baseline
of the evaluator. Prompts of different lengths are right-padded to a bucketed length; each row's
cache length is then set to its own prompt length, so padding is never attended to.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding.prompts import in_prompt_order, length_sorted_batches, pad_prompts
from dflash_jax.decoding.sampling import SamplingConfig, pick_token


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
    on_batch=None,
) -> list[list[int]]:
    """Generate a continuation for each prompt (token id lists). Each output stops after its first
    EOS (included) or at ``max_new_tokens``. ``progress(n)`` is called after each batch, and
    ``on_batch(prompt indices, their outputs)`` as soon as a batch is done (what writes answers as
    they come)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = sampling or SamplingConfig()
    eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
    key = jax.random.key(seed)
    batches = length_sorted_batches(prompts, batch_size)
    batch_outputs = []
    for idx in batches:
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
        batch_outputs.append([tokens[r, : n_out[r]].tolist() for r in range(len(idx))])
        if on_batch is not None:
            on_batch(list(idx), batch_outputs[-1])
        if progress is not None:
            progress(len(idx))
    return in_prompt_order(batches, batch_outputs)
