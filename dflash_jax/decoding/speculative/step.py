"""The jitted pieces of speculative decoding: prefill, draft, and one draft + verify step.

Graphdefs are static and states traced, so each piece compiles once per shape and is reused across
calls and decoder instances.

One step per row (z-lab's ``dflash_generate``, batched with per-row lengths):

* block = ``[last token, mask x (S-1)]`` at positions ``start .. start+S-1``; the drafter first
  appends the target features of the tokens accepted last step to its context cache, then drafts
  slots 1..S-1;
* the target runs the S block tokens on its KV cache (also returning the features of the drafter's
  ``target_layer_ids``) and the acceptance rule (``acceptance.py``) keeps a prefix of the drafts
  and adds a bonus token;
* ``produced = accepted + 1`` tokens are emitted (cut by the length limit and at the first stop
  token), ``start += produced``, the target cache is cropped to ``start`` and the features of the
  produced tokens become the drafter's next context.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.decoding.sampling import SamplingConfig, pick_token
from dflash_jax.decoding.speculative.acceptance import accept_greedy, accept_sampled, propose
from dflash_jax.decoding.speculative.state import DecodeState, take_rows


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "block_size", "max_new_tokens", "sampling"))
def prefill(
    t_graph,
    t_state,
    d_graph,
    d_state,
    ids,
    lengths,
    done,
    stop_ids,
    key,
    *,
    block_size,
    max_new_tokens,
    sampling,
) -> DecodeState:
    """The prompts through the target (first token picked) and into the drafter's context."""
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    cfg = drafter.config
    B, P = ids.shape
    S = block_size
    capacity = P + max_new_tokens + S
    out = target(
        ids, cache=target.init_cache(B, capacity), layer_ids=cfg.target_layer_ids, return_logits=False
    )
    target_cache = out.cache.with_lengths(lengths)
    first = pick_token(target.logits(take_rows(out.hidden, lengths - 1)), sampling, key)

    # The whole prompt becomes drafter context now; the 1-slot block drafted alongside is unused.
    drafter_cache = drafter.init_cache(B, capacity)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    dummy = drafter.embed_blocks(target, jnp.full((B, 1), cfg.mask_token_id, jnp.int32))
    _, drafter_cache = drafter.forward_infer(
        out.features, positions, dummy, lengths[:, None], drafter_cache, new_ctx_lens=lengths
    )

    seq = jnp.full((B, capacity + 1), cfg.mask_token_id, jnp.int32)
    seq = seq.at[:, :P].set(ids)
    seq = seq.at[jnp.arange(B), lengths].set(first)
    max_len = lengths + max_new_tokens
    done = done | jnp.isin(first, stop_ids) | (lengths + 1 >= max_len)
    M = max(max_new_tokens, 1)
    return DecodeState(
        seq=seq,
        start=lengths,
        max_len=max_len,
        done=done,
        target_cache=target_cache,
        drafter_cache=drafter_cache,
        pending_features=jnp.zeros((B, S, out.features.shape[-1]), out.features.dtype),
        pending_count=jnp.zeros((B,), jnp.int32),
        steps=jnp.zeros((B,), jnp.int32),
        log_produced=jnp.zeros((B, M), jnp.int32),
        log_accepted=jnp.zeros((B, M), jnp.int32),
        log_drafted=jnp.zeros((B, M), jnp.int32),
    )


def draft(target, drafter, state: DecodeState, draft_len: int, sampling: SamplingConfig, key):
    """Append the pending context, draft ``draft_len - 1`` tokens -> (tokens, logq | None, drafter cache)."""
    cfg = drafter.config
    B, S = state.pending_features.shape[:2]
    ctx_pos = (state.start - state.pending_count)[:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    last = take_rows(state.seq, state.start)
    ids = jnp.concatenate([last[:, None], jnp.full((B, draft_len - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    block_pos = state.start[:, None] + jnp.arange(draft_len, dtype=jnp.int32)[None]
    hidden, drafter_cache = drafter.forward_infer(
        state.pending_features,
        ctx_pos,
        drafter.embed_blocks(target, ids),
        block_pos,
        state.drafter_cache,
        new_ctx_lens=state.pending_count,
    )
    tokens, logq = propose(drafter, target, drafter.logits(hidden[:, 1:], target), sampling, key)
    return tokens, logq, drafter_cache


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "draft_len", "sampling"))
def draft_only(t_graph, t_state, d_graph, d_state, state, key, *, draft_len, sampling):
    """Drafts of a shorter block (``draft_len`` slots), for rows near their length limit."""
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    tokens, logq, _ = draft(target, drafter, state, draft_len, sampling, key)
    return tokens, logq


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "sampling"), donate_argnames=("state",))
def decode_step(
    t_graph, t_state, d_graph, d_state, state: DecodeState, override, stop_ids, key, *, sampling
) -> DecodeState:
    """One draft + verify step for every row; done rows pass through unchanged.

    ``override = (rows [B] bool, drafts [B, S-1], logq [B, S-1, V] | None)``: drafts made with a
    shorter block for rows near their length limit (see ``draft_only``)."""
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    cfg = drafter.config
    B, S = state.pending_features.shape[:2]
    k_draft, k_accept, k_bonus = jax.random.split(key, 3)
    drafts, logq, drafter_cache = draft(target, drafter, state, S, sampling, k_draft)
    rows, o_drafts, o_logq = override
    drafts = jnp.where(rows[:, None], o_drafts, drafts)
    if logq is not None:
        logq = jnp.where(rows[:, None, None], o_logq, logq)

    start, active = state.start, ~state.done
    last = take_rows(state.seq, start)
    block = jnp.concatenate([last[:, None], drafts], axis=1)
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    out = target(block, positions, layer_ids=cfg.target_layer_ids, cache=state.target_cache)

    verify = jnp.minimum(S, state.max_len - start)  # z-lab's verify_size
    if sampling.temperature == 0:
        accepted, bonus = accept_greedy(drafts, out.logits, verify)
    else:
        accepted, bonus = accept_sampled(drafts, logq, out.logits, verify, sampling, k_accept, k_bonus)

    # New tokens at positions start+1 ..: accepted drafts, then the bonus.
    slot = jnp.arange(S)[None]
    drafts_ext = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    new = jnp.where(
        slot < accepted[:, None],
        drafts_ext,
        jnp.where(slot == accepted[:, None], bonus[:, None], cfg.mask_token_id),
    )
    produced = jnp.minimum(accepted + 1, state.max_len - start - 1)
    is_stop = jnp.isin(new, stop_ids) & (slot < produced[:, None])
    stopped = jnp.any(is_stop, axis=1)
    produced = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, produced)
    produced = jnp.where(active, produced, 0).astype(jnp.int32)

    def write(row, tokens, s, keep):
        old = jax.lax.dynamic_slice_in_dim(row, s + 1, S)
        return jax.lax.dynamic_update_slice_in_dim(row, jnp.where(keep, old, tokens), s + 1, axis=0)

    seq = jax.vmap(write)(state.seq, new, start, ~active)
    new_start = start + produced

    def record(logs, value):
        return logs.at[jnp.arange(B), state.steps].set(
            jnp.where(active, value, logs[jnp.arange(B), state.steps])
        )

    return DecodeState(
        seq=seq,
        start=new_start,
        max_len=state.max_len,
        done=state.done | (active & (stopped | (new_start + 1 >= state.max_len))),
        target_cache=out.cache.with_lengths(new_start),
        drafter_cache=drafter_cache,
        pending_features=out.features.astype(state.pending_features.dtype),
        pending_count=produced,
        steps=state.steps + active.astype(jnp.int32),
        log_produced=record(state.log_produced, produced),
        log_accepted=record(state.log_accepted, accepted.astype(jnp.int32)),
        log_drafted=record(state.log_drafted, (verify - 1).astype(jnp.int32)),
    )
