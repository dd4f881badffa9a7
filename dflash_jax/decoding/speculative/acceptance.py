"""The acceptance rule: which drafts the target keeps and which token it adds after them.

Drafts come from the drafter's logits; with a draft vocabulary (invariant 9) those logits cover
only its ids, so a draft index is mapped back to its target id (greedy) or the drafter's
distribution q is spread over the target's ids, 0 outside the set (sampling).

* Greedy: the longest prefix of drafts equal to the target's argmax is accepted, the bonus is the
  target's argmax right after it. Emits exactly the target's greedy tokens (invariant 8).
* Sampling (standard speculative sampling, lossless in distribution): draft k is kept when
  ``u * q(x_k) < p(x_k)``; on the first rejection the bonus is drawn from
  ``normalize(max(p - q, 0))``, else from p.

``verify`` [B] is the number of block slots the target checks per row (``min(S, max_len - start)``):
at most ``verify - 1`` drafts can be accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decoding.sampling import SamplingConfig, sampling_logprobs
from dflash_jax.decoding.speculative.state import take_rows


def propose(drafter, target, logits, sampling: SamplingConfig, key):
    """Drafter logits [B, n, N] -> (draft token ids in the target's vocabulary [B, n], the drafter's
    log q over the target's ids [B, n, V] when sampling, else None)."""
    if sampling.temperature == 0:  # a draft-vocabulary index -> its target id (invariant 9)
        return drafter.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
    if drafter.draft_vocab is not None:  # q over the target's ids: 0 outside the draft vocabulary
        full = jnp.full((*logits.shape[:-1], target.config.vocab_size), -jnp.inf, logits.dtype)
        logits = full.at[..., drafter.draft_vocab[...]].set(logits)
    logq = sampling_logprobs(logits, sampling)
    return jax.random.categorical(key, logq, axis=-1).astype(jnp.int32), logq


def accept_greedy(drafts, target_logits, verify):
    """drafts [B, S-1], target logits over the block [B, S, V] -> (accepted [B], bonus [B])."""
    posterior = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    ok = drafts == posterior[:, :-1]
    accepted = jnp.minimum(jnp.sum(jnp.cumprod(ok, axis=1), axis=1), verify - 1)
    return accepted, take_rows(posterior, accepted)


def accept_sampled(drafts, logq, target_logits, verify, sampling: SamplingConfig, accept_key, bonus_key):
    """Speculative sampling of drafts [B, S-1] drawn from ``logq`` [B, S-1, V] against the target's
    block logits [B, S, V] -> (accepted [B], bonus [B])."""
    S = target_logits.shape[1]
    draft_slot = jnp.arange(S - 1)[None]
    logp = sampling_logprobs(target_logits, sampling)  # [B, S, V]
    p_tok = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts[..., None], axis=-1)[..., 0])
    q_tok = jnp.exp(jnp.take_along_axis(logq, drafts[..., None], axis=-1)[..., 0])
    ok = (jax.random.uniform(accept_key, p_tok.shape) * q_tok < p_tok) & (draft_slot < verify[:, None] - 1)
    accepted = jnp.minimum(jnp.sum(jnp.cumprod(ok, axis=1), axis=1), verify - 1)
    p_at = jnp.exp(take_rows(logp, accepted))
    q_at = jnp.exp(take_rows(logq, jnp.minimum(accepted, S - 2)))
    resid = jnp.maximum(p_at - q_at, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    rejected = (accepted < verify - 1)[:, None] & (total > 0)
    dist = jnp.where(rejected, resid / jnp.maximum(total, jnp.finfo(jnp.float32).tiny), p_at)
    bonus = jax.random.categorical(bonus_key, jnp.log(dist), axis=-1).astype(jnp.int32)
    return accepted, bonus
