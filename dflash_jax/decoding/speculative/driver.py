"""The speculative decoding driver: the Python loop over jitted steps, batching and results.

Accounting follows z-lab exactly so per-step lists compare one to one: ``acceptance_lengths`` holds
``produced`` per step, including stop-token and max-length truncation, and near the length limit
the block shrinks to ``min(S, max_length - start)`` slots (the drafter really drafts the shorter
block, as its bidirectional in-block attention depends on the block length).

Shapes are fixed per compile (``state.py``) and one jitted step (draft + verify, ``step.py``) is
called per loop iteration. Rows in the last few steps before their length limit get their shorter
drafts from an extra, separately compiled drafter call (at most S-2 variants; ``exact_tail=False``
skips them).

Temperature > 0 (flagged ``lossless in distribution``, not token-exact with any other
implementation): standard speculative sampling (``acceptance.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding.prompts import in_prompt_order, length_sorted_batches, pad_prompts
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.speculative.state import DecodeState
from dflash_jax.decoding.speculative.step import decode_step, draft_only, prefill

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
        if attention_impl is not None:
            from dflash_jax.drafter.api import with_attention_impl

            drafter = with_attention_impl(drafter, attention_impl)
            cfg = drafter.config
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
        """The "no override" input of decode_step, made once per batch and left on the device."""
        S = self.block_size
        logq = None if self.sampling.temperature == 0 else jnp.zeros((B, S - 1, V), jnp.float32)
        return (jnp.zeros((B,), bool), jnp.zeros((B, S - 1), jnp.int32), logq)

    def _tail_drafts(self, state: DecodeState, verify: np.ndarray, active: np.ndarray, key):
        """Drafts of the rows whose block is cut by their length limit, drafted at that length.

        Built on the host and uploaded like ``_override_none``'s arrays (same placement, so decode_step
        is not recompiled for it)."""
        B, S = len(verify), self.block_size
        rows, drafts = np.zeros((B,), bool), np.full((B, S - 1), -1, np.int32)
        logq = None if self.sampling.temperature == 0 else np.zeros((B, S - 1, self.vocab_size), np.float32)
        for n, v in enumerate(sorted(set(verify[active & (verify < S)].tolist()))):
            tail_tokens, tail_logq = jax.device_get(
                draft_only(
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
            drafts[sel, : v - 1] = tail_tokens[sel]  # -1 after them: never a target token, never checked
            if logq is not None:
                logq[sel, : v - 1] = tail_logq[sel]
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
        state = prefill(
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
        no_override = self._override_none(B, self.vocab_size)
        step_index = 0
        while True:
            start, max_len, done = jax.device_get((state.start, state.max_len, state.done))
            active = ~done
            if not active.any():
                break
            step_key = jax.random.fold_in(key, step_index)
            verify = np.minimum(self.block_size, max_len - start)
            override = no_override
            if self.exact_tail and (verify[active] < self.block_size).any():
                override = self._tail_drafts(state, verify, active, jax.random.fold_in(step_key, 1))
            state = decode_step(
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
            step_index += 1

        seq, start, max_len, num_steps, produced_log, accepted_log, drafted_log = jax.device_get(
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
            output_ids = seq[r, len(p) : end].tolist()
            steps = int(num_steps[r])
            results.append(
                SpecOutput(
                    prompt_len=len(p),
                    output_ids=output_ids,
                    acceptance_lengths=produced_log[r, :steps].tolist(),
                    accepted=accepted_log[r, :steps].tolist(),
                    drafted=drafted_log[r, :steps].tolist(),
                    stopped=bool(output_ids) and output_ids[-1] in stop_set,
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
        batches = length_sorted_batches(prompts, batch_size)
        batch_outputs = []
        for b, idx in enumerate(batches):
            batch_outputs.append(
                self.run_batch(
                    [prompts[i] for i in idx],
                    max_new_tokens=max_new_tokens,
                    stop_token_ids=stop_token_ids,
                    batch_size=batch_size,
                    key=jax.random.fold_in(key, b),
                )
            )
            if progress is not None:
                progress(len(idx))
        return in_prompt_order(batches, batch_outputs)


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
