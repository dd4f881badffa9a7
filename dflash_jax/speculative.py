"""Batched DFlash speculative decoding in JAX: the drafter proposes a block, the target verifies it.

One decoding step per row (z-lab's ``dflash_generate``, batched with per-row lengths):

* block = ``[last token, mask x (S-1)]`` at positions ``start .. start+S-1``; the drafter first
  appends the target features of the tokens accepted last step to its context cache, then drafts
  slots 1..S-1 (argmax, or sampled at temperature > 0);
* the target runs the S block tokens on its KV cache (also returning the features of the drafter's
  ``target_layer_ids``) and accepts the longest prefix of drafts equal to its own argmax; the bonus
  token is its argmax right after that prefix;
* ``produced = accepted + 1`` tokens are emitted (cut by the length limit and at the first stop
  token), ``start += produced``, the target cache is cropped to ``start`` and the features of the
  produced tokens become the drafter's next context.

Accounting follows z-lab exactly so per-step lists compare one to one: ``acceptance_lengths`` holds
``produced`` per step, including stop-token and max-length truncation, and near the length limit
the block shrinks to ``min(S, max_length - start)`` slots (the drafter really drafts the shorter
block, as its bidirectional in-block attention depends on the block length).

Shapes are fixed per compile: the output buffer, the target KV cache and the drafter context cache
are preallocated with per-row lengths, and one jitted step (draft + verify) is called from a
Python loop. Rows in the last few steps before their length limit get their shorter drafts from
an extra, separately compiled drafter call (at most S-2 variants; ``exact_tail=False`` skips them).

Temperature > 0 (flagged ``lossless in distribution``, not token-exact with any other
implementation): drafts are sampled from the drafter's filtered distribution q, draft k is kept
when ``u * q(x_k) < p(x_k)`` and on the first rejection the bonus is drawn from
``normalize(max(p - q, 0))`` (standard speculative sampling), else from p.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.generate import SamplingConfig, pad_prompts, pick_token, sampling_logprobs

log = logging.getLogger(__name__)


@dataclass
class SpecOutput:
    """One prompt's result.

    output_ids          the generated tokens (first token from the prefill included)
    acceptance_lengths  per verify step, the tokens it produced (z-lab's list: accepted drafts + the
                        bonus, cut at a stop token or the length limit)
    accepted            per verify step, the number of drafts accepted (before those cuts)
    drafted             per verify step, the number of drafts the target checked (S-1, fewer near
                        the length limit)
    """

    prompt_len: int
    output_ids: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    stopped: bool = False

    @property
    def num_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def target_forwards(self) -> int:
        """Target forward passes used: the prefill plus one per verify step."""
        return 1 + self.num_steps


@jax.tree_util.register_dataclass
@dataclass
class _State:
    seq: jax.Array  # [B, L] int32 prompt + generated tokens
    start: jax.Array  # [B] index of the last emitted token (not yet in the target cache)
    max_len: jax.Array  # [B] prompt length + max_new_tokens
    done: jax.Array  # [B] bool
    tcache: object  # target KVCache, lengths == start
    dcache: object  # DrafterCache, lengths == start - pend_n
    pend_feats: jax.Array  # [B, S, K*D] target features not yet in the drafter cache
    pend_n: jax.Array  # [B] how many of them are real
    steps: jax.Array  # [B] verify steps done
    log_produced: jax.Array  # [B, M]
    log_accepted: jax.Array  # [B, M]
    log_drafted: jax.Array  # [B, M]


def _take_rows(x, idx):
    """x [B, L, ...], idx [B] -> x[b, idx[b]]."""
    return x[jnp.arange(x.shape[0]), idx.astype(jnp.int32)]


# ------------------------------------------------------------------------------------------
# jitted pieces (graphdefs static, states traced: compiled once per shape, reused across calls)
# ------------------------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "block_size", "max_new_tokens", "sampling"))
def _prefill(
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
):
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    cfg = drafter.config
    B, P = ids.shape
    S = block_size
    capacity = P + max_new_tokens + S
    out = target(
        ids, cache=target.init_cache(B, capacity), layer_ids=cfg.target_layer_ids, return_logits=False
    )
    tcache = out.cache.with_lengths(lengths)
    first = pick_token(target.logits(_take_rows(out.hidden, lengths - 1)), sampling, key)

    # The whole prompt becomes drafter context now; the 1-slot block drafted alongside is unused.
    dcache = drafter.init_cache(B, capacity)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    dummy = drafter.embed_blocks(target, jnp.full((B, 1), cfg.mask_token_id, jnp.int32))
    _, dcache = drafter.forward_infer(
        out.features, positions, dummy, lengths[:, None], dcache, new_ctx_lens=lengths
    )

    seq = jnp.full((B, capacity + 1), cfg.mask_token_id, jnp.int32)
    seq = seq.at[:, :P].set(ids)
    seq = seq.at[jnp.arange(B), lengths].set(first)
    max_len = lengths + max_new_tokens
    done = done | jnp.isin(first, stop_ids) | (lengths + 1 >= max_len)
    M = max(max_new_tokens, 1)
    return _State(
        seq=seq,
        start=lengths,
        max_len=max_len,
        done=done,
        tcache=tcache,
        dcache=dcache,
        pend_feats=jnp.zeros((B, S, out.features.shape[-1]), out.features.dtype),
        pend_n=jnp.zeros((B,), jnp.int32),
        steps=jnp.zeros((B,), jnp.int32),
        log_produced=jnp.zeros((B, M), jnp.int32),
        log_accepted=jnp.zeros((B, M), jnp.int32),
        log_drafted=jnp.zeros((B, M), jnp.int32),
    )


def _draft(target, drafter, state: _State, draft_len: int, sampling: SamplingConfig, key):
    """Append the pending context, draft ``draft_len - 1`` tokens -> (tokens, logq | None, dcache)."""
    cfg = drafter.config
    B, S = state.pend_feats.shape[:2]
    ctx_pos = (state.start - state.pend_n)[:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    last = _take_rows(state.seq, state.start)
    ids = jnp.concatenate([last[:, None], jnp.full((B, draft_len - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    block_pos = state.start[:, None] + jnp.arange(draft_len, dtype=jnp.int32)[None]
    hidden, dcache = drafter.forward_infer(
        state.pend_feats,
        ctx_pos,
        drafter.embed_blocks(target, ids),
        block_pos,
        state.dcache,
        new_ctx_lens=state.pend_n,
    )
    logits = drafter.logits(hidden[:, 1:], target)
    if sampling.temperature == 0:  # a draft-vocabulary index -> its target id (invariant 9)
        return drafter.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32)), None, dcache
    if drafter.draft_vocab is not None:  # q over the target's ids: 0 outside the draft vocabulary
        full = jnp.full((*logits.shape[:-1], target.config.vocab_size), -jnp.inf, logits.dtype)
        logits = full.at[..., drafter.draft_vocab[...]].set(logits)
    logq = sampling_logprobs(logits, sampling)
    return jax.random.categorical(key, logq, axis=-1).astype(jnp.int32), logq, dcache


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "draft_len", "sampling"))
def _draft_only(t_graph, t_state, d_graph, d_state, state, key, *, draft_len, sampling):
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    tokens, logq, _ = _draft(target, drafter, state, draft_len, sampling, key)
    return tokens, logq


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "sampling"), donate_argnames=("state",))
def _step(t_graph, t_state, d_graph, d_state, state: _State, override, stop_ids, key, *, sampling):
    """One draft + verify step for every row; done rows pass through unchanged.

    ``override = (rows [B] bool, drafts [B, S-1], logq [B, S-1, V] | None)``: drafts made with a
    shorter block for rows near their length limit (see ``_tail_drafts``)."""
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    cfg = drafter.config
    B, S = state.pend_feats.shape[:2]
    k_draft, k_accept, k_bonus = jax.random.split(key, 3)
    drafts, logq, dcache = _draft(target, drafter, state, S, sampling, k_draft)
    rows, o_drafts, o_logq = override
    drafts = jnp.where(rows[:, None], o_drafts, drafts)
    if logq is not None:
        logq = jnp.where(rows[:, None, None], o_logq, logq)

    start, active = state.start, ~state.done
    last = _take_rows(state.seq, start)
    block = jnp.concatenate([last[:, None], drafts], axis=1)
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    out = target(block, positions, layer_ids=cfg.target_layer_ids, cache=state.tcache)

    verify = jnp.minimum(S, state.max_len - start)  # z-lab's verify_size
    k_idx = jnp.arange(S - 1)[None]
    if sampling.temperature == 0:
        posterior = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        ok = drafts == posterior[:, :-1]
        accepted = jnp.minimum(jnp.sum(jnp.cumprod(ok, axis=1), axis=1), verify - 1)
        bonus = _take_rows(posterior, accepted)
    else:
        logp = sampling_logprobs(out.logits, sampling)  # [B, S, V]
        p_tok = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts[..., None], axis=-1)[..., 0])
        q_tok = jnp.exp(jnp.take_along_axis(logq, drafts[..., None], axis=-1)[..., 0])
        ok = (jax.random.uniform(k_accept, p_tok.shape) * q_tok < p_tok) & (k_idx < verify[:, None] - 1)
        accepted = jnp.minimum(jnp.sum(jnp.cumprod(ok, axis=1), axis=1), verify - 1)
        p_at = jnp.exp(_take_rows(logp, accepted))
        q_at = jnp.exp(_take_rows(logq, jnp.minimum(accepted, S - 2)))
        resid = jnp.maximum(p_at - q_at, 0.0)
        total = jnp.sum(resid, axis=-1, keepdims=True)
        rejected = (accepted < verify - 1)[:, None] & (total > 0)
        dist = jnp.where(rejected, resid / jnp.maximum(total, jnp.finfo(jnp.float32).tiny), p_at)
        bonus = jax.random.categorical(k_bonus, jnp.log(dist), axis=-1).astype(jnp.int32)

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

    return _State(
        seq=seq,
        start=new_start,
        max_len=state.max_len,
        done=state.done | (active & (stopped | (new_start + 1 >= state.max_len))),
        tcache=out.cache.with_lengths(new_start),
        dcache=dcache,
        pend_feats=out.features.astype(state.pend_feats.dtype),
        pend_n=produced,
        steps=state.steps + active.astype(jnp.int32),
        log_produced=record(state.log_produced, produced),
        log_accepted=record(state.log_accepted, accepted.astype(jnp.int32)),
        log_drafted=record(state.log_drafted, (verify - 1).astype(jnp.int32)),
    )


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------


class SpeculativeDecoder:
    """Holds the split target/drafter and runs batches. Reuse one instance for many prompts.

    ``block_size``: default the drafter's. ``attention_impl``: run the drafter with this attention
    implementation instead of its config's (None: keep).
    """

    def __init__(
        self,
        target,
        drafter,
        *,
        block_size: int | None = None,
        sampling: SamplingConfig | None = None,
        exact_tail: bool = True,
        attention_impl: str | None = None,
    ):
        cfg = drafter.config
        cfg.check_target(target.config)
        if attention_impl is not None and attention_impl != cfg.attention_impl:
            # e.g. a drafter fresh from training with the Pallas kernel: decode with another impl.
            from dflash_jax.drafter.model import WEIGHTS, DFlashDrafter

            cfg = cfg.replace(attention_impl=attention_impl)
            params = nnx.state(drafter, WEIGHTS)
            drafter = nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0)))
            nnx.update(drafter, params)
        self.block_size = int(block_size if block_size is not None else cfg.block_size)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 for speculative decoding, got {self.block_size}")
        self.sampling = sampling or SamplingConfig()
        # False: near the length limit draft the full block anyway (no extra compiles; tokens are
        # unchanged, only the acceptance counts of those last steps can differ from z-lab's).
        self.exact_tail = exact_tail
        self.mask_token_id = cfg.mask_token_id
        self.vocab_size = target.config.vocab_size
        self.t_graph, self.t_state = nnx.split(target)
        self.d_graph, self.d_state = nnx.split(drafter)

    def _override_none(self, B: int, V: int):
        """The "no override" input of _step, made once per batch and left on the device."""
        S = self.block_size
        logq = None if self.sampling.temperature == 0 else jnp.zeros((B, S - 1, V), jnp.float32)
        return (jnp.zeros((B,), bool), jnp.zeros((B, S - 1), jnp.int32), logq)

    def _tail_drafts(self, state: _State, verify: np.ndarray, active: np.ndarray, key):
        """Drafts of the rows whose block is cut by their length limit, drafted at that length.

        Built on the host and uploaded like ``_override_none``'s arrays (same placement, so _step
        is not recompiled for it)."""
        B, S = len(verify), self.block_size
        rows, drafts = np.zeros((B,), bool), np.full((B, S - 1), -1, np.int32)
        logq = None if self.sampling.temperature == 0 else np.zeros((B, S - 1, self.vocab_size), np.float32)
        for n, v in enumerate(sorted(set(verify[active & (verify < S)].tolist()))):
            tok, lq = jax.device_get(
                _draft_only(
                    self.t_graph,
                    self.t_state,
                    self.d_graph,
                    self.d_state,
                    state,
                    jax.random.fold_in(key, n),
                    draft_len=int(v),
                    sampling=self.sampling,
                )
            )
            sel = active & (verify == v)
            drafts[sel, : v - 1] = tok[sel]  # -1 after them: never a target token, never checked
            if logq is not None:
                logq[sel, : v - 1] = lq[sel]
            rows |= sel
        return jnp.asarray(rows), jnp.asarray(drafts), None if logq is None else jnp.asarray(logq)

    def run_batch(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop_token_ids=(),
        batch_size: int | None = None,
        key=None,
    ) -> list[SpecOutput]:
        """Decode one batch (len(prompts) <= batch_size; the rest is padding)."""
        B = batch_size or len(prompts)
        if not 0 < len(prompts) <= B:
            raise ValueError(f"run_batch: {len(prompts)} prompts for a batch of {B}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
                )
        key = jax.random.key(0) if key is None else key
        ids, lengths = pad_prompts(prompts, B)
        done = np.arange(B) >= len(prompts)
        stops = jnp.asarray(list(stop_token_ids) or [-1], jnp.int32)
        key, sub = jax.random.split(key)
        state = _prefill(
            self.t_graph,
            self.t_state,
            self.d_graph,
            self.d_state,
            jnp.asarray(ids),
            jnp.asarray(lengths),
            jnp.asarray(done),
            stops,
            sub,
            block_size=self.block_size,
            max_new_tokens=max_new_tokens,
            sampling=self.sampling,
        )
        none = self._override_none(B, self.vocab_size)
        n = 0
        while True:
            start, max_len, done = jax.device_get((state.start, state.max_len, state.done))
            active = ~done
            if not active.any():
                break
            step_key = jax.random.fold_in(key, n)
            verify = np.minimum(self.block_size, max_len - start)
            override = none
            if self.exact_tail and (verify[active] < self.block_size).any():
                override = self._tail_drafts(state, verify, active, jax.random.fold_in(step_key, 1))
            state = _step(
                self.t_graph,
                self.t_state,
                self.d_graph,
                self.d_state,
                state,
                override,
                stops,
                jax.random.fold_in(step_key, 0),
                sampling=self.sampling,
            )
            n += 1

        seq, start, max_len, steps, lp, la, ld = jax.device_get(
            (
                state.seq,
                state.start,
                state.max_len,
                state.steps,
                state.log_produced,
                state.log_accepted,
                state.log_drafted,
            )
        )
        stop_set = set(int(s) for s in stop_token_ids)
        results = []
        for r, p in enumerate(prompts):
            end = min(int(start[r]) + 1, int(max_len[r]))
            out = seq[r, len(p) : end].tolist()
            k = int(steps[r])
            results.append(
                SpecOutput(
                    prompt_len=len(p),
                    output_ids=out,
                    acceptance_lengths=lp[r, :k].tolist(),
                    accepted=la[r, :k].tolist(),
                    drafted=ld[r, :k].tolist(),
                    stopped=bool(out) and out[-1] in stop_set,
                )
            )
        return results

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop_token_ids=(),
        batch_size: int = 8,
        seed: int = 0,
        progress=None,
    ) -> list[SpecOutput]:
        """Decode every prompt (token id lists), ``batch_size`` at a time, similar lengths together."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        key = jax.random.key(seed)
        results: list[SpecOutput | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for b, s in enumerate(range(0, len(order), batch_size)):
            idx = order[s : s + batch_size]
            outs = self.run_batch(
                [prompts[i] for i in idx],
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
                batch_size=batch_size,
                key=jax.random.fold_in(key, b),
            )
            for i, o in zip(idx, outs, strict=True):
                results[i] = o
            if progress is not None:
                progress(len(idx))
        return results  # type: ignore[return-value]


def speculative_generate(
    target,
    drafter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_token_ids=(),
    block_size: int | None = None,
    sampling: SamplingConfig | None = None,
    batch_size: int = 8,
    seed: int = 0,
    progress=None,
) -> list[SpecOutput]:
    """Speculative decoding of token-id prompts with ``drafter`` proposing for ``target``.

    Greedy (the default) emits exactly the target's greedy tokens (invariant 8). Each output stops
    after its first stop token (included) or at ``max_new_tokens``.
    """
    dec = SpeculativeDecoder(target, drafter, block_size=block_size, sampling=sampling)
    return dec.generate(
        prompts,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )


__all__ = ["SpecOutput", "SpeculativeDecoder", "speculative_generate"]
