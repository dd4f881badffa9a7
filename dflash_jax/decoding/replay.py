"""Tau by replay: what greedy speculative decoding would accept, from the target's greedy answers.

Greedy speculative decoding emits exactly the target's greedy tokens (invariant 8), so once those
tokens are known, every verify step of a decode is known too: it starts at the last emitted token,
the drafter sees the target features of everything before it, and the step keeps the drafts that
equal the next greedy tokens. Replay computes the target features of prompt + answer in one
forward (kept for every later replay: the target is frozen), drafts a block at every answer
position in one drafter forward (``forward_train``: block j sees context < its anchor, as in
decoding) and walks the steps the decoder would take, with the same accounting as
``decoding.speculative`` (``produced`` cut at a stop token and at ``max_new_tokens``; blocks
drafted at full length near the limit, like ``evaluate(exact_tail=False)``).

What can differ from real decoding: float rounding (one forward against KV-cached verify steps;
a near-tie argmax can flip), and a draft that matches what the target would predict *after* a stop
token is counted as rejected (the answer ends there); the tokens produced, and so tau, do not
depend on the latter. A measurement by replay costs one drafter forward over the answers instead
of a decode: seconds instead of minutes on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding.prompts import bucket_length
from dflash_jax.decoding.speculative.driver import SpecOutput


def walk(
    prompt_len: int,
    answer: Sequence[int],
    drafts: np.ndarray,
    *,
    max_new_tokens: int,
    block_size: int,
    stop_token_ids: Sequence[int] = (),
) -> SpecOutput:
    """The verify steps of one greedy decode whose output is ``answer`` (the target's greedy tokens,
    its stop token included when it stopped); ``drafts[j]`` [S-1] are the drafter's tokens for the
    block anchored at ``answer[j]``. The result is what the decoder's own ``SpecOutput`` would be."""
    y, M, S = [int(t) for t in answer], max_new_tokens, block_size
    stops = set(int(s) for s in stop_token_ids)
    out = SpecOutput(prompt_len=prompt_len, output_ids=[])
    if not y:
        return out
    j = 0
    stopped = y[0] in stops
    while not stopped and j + 1 < M:
        verify = min(S, M - j)
        accepted = 0
        while (
            accepted < verify - 1 and j + 1 + accepted < len(y) and drafts[j][accepted] == y[j + 1 + accepted]
        ):
            accepted += 1
        produced = min(accepted + 1, M - 1 - j)
        new = y[j + 1 : j + 1 + produced]
        for i, t in enumerate(new):
            if t in stops:
                produced, stopped = i + 1, True
                break
        if not stopped and len(new) < produced:
            raise ValueError(
                f"answer of {len(y)} tokens ends without a stop token before max_new_tokens={M}: "
                "not the greedy output this replay needs"
            )
        out.acceptance_lengths.append(produced)
        out.accepted.append(accepted)
        out.drafted.append(verify - 1)
        j += produced
    out.output_ids = y[: j + 1]
    out.stopped = stopped
    return out


@partial(jax.jit, static_argnames=("t_graph", "layer_ids"))
def _target_features(t_graph, t_state, ids, *, layer_ids):
    target = nnx.merge(t_graph, t_state)
    return target(ids, layer_ids=layer_ids, return_logits=False).features


@partial(jax.jit, static_argnames=("t_graph", "d_graph"))
def _draft_every_position(t_graph, t_state, d_graph, d_state, ids, features, segment_ids, anchors, valid):
    """-> [R, A, S-1] the drafter's greedy tokens (target ids) of the block at every anchor."""
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    R, T = ids.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    blocks = drafter.train_block_embeds(target, ids, anchors)
    hidden = drafter.forward_train(features, positions, segment_ids, anchors, valid, blocks)
    logits = drafter.logits(hidden[:, :, 1:], target)
    return drafter.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32))


class Replay:
    """The held-out answers of one target, ready to replay any drafter with these taps against.

    ``prompts``/``answers``: token ids; an answer is the target's greedy output for its prompt at
    ``max_new_tokens`` with ``stop_token_ids`` (``decoding.generate``). Rows go ``batch_size`` at a
    time; the target features are computed at the first replay and kept on the device.
    """

    def __init__(
        self,
        target,
        prompts: Sequence[Sequence[int]],
        answers: Sequence[Sequence[int]],
        *,
        layer_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        batch_size: int = 8,
    ):
        if len(prompts) != len(answers):
            raise ValueError(f"replay: {len(prompts)} prompts but {len(answers)} answers")
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            if not p or not a or len(a) > max_new_tokens:
                raise ValueError(
                    f"replay: prompt {i} has {len(p)} tokens and answer {len(a)} (each needs >= 1, "
                    f"answers at most max_new_tokens={max_new_tokens})"
                )
        self.target, self.layer_ids = target, tuple(int(i) for i in layer_ids)
        self.prompts = [list(map(int, p)) for p in prompts]
        self.answers = [list(map(int, a)) for a in answers]
        self.max_new_tokens, self.stop_token_ids = max_new_tokens, tuple(int(s) for s in stop_token_ids)
        self.batch_size = max(1, min(batch_size, len(prompts)))
        self._rows = None

    def _prepare(self):
        """Per batch of rows: ids, target features, segment ids, anchors and their validity."""
        R, A = self.batch_size, max(1, self.max_new_tokens - 1)
        T = bucket_length(max(len(p) + len(a) for p, a in zip(self.prompts, self.answers, strict=True)))
        t_graph, t_state = nnx.split(self.target)
        rows = []
        for b0 in range(0, len(self.prompts), R):
            ids = np.zeros((R, T), np.int32)
            seg = np.zeros((R, T), np.int32)
            anchors = np.full((R, A), T - 1, np.int32)  # padding anchors: last, invalid (ascending)
            valid = np.zeros((R, A), bool)
            for r, (p, a) in enumerate(
                zip(self.prompts[b0 : b0 + R], self.answers[b0 : b0 + R], strict=True)
            ):
                n = len(p) + len(a)
                ids[r, :n] = p + a
                seg[r, :n] = 1
                steps = min(len(a) - 1, A)  # a block at every answer token but the last
                anchors[r, :steps] = len(p) + np.arange(steps)
                valid[r, :steps] = True
            ids_d = jnp.asarray(ids)
            feats = _target_features(t_graph, t_state, ids_d, layer_ids=self.layer_ids)
            rows.append((b0, ids_d, feats, jnp.asarray(seg), jnp.asarray(anchors), jnp.asarray(valid)))
        return rows

    def outputs(self, drafter) -> list[SpecOutput]:
        """The replayed decode of every prompt with ``drafter``, in prompt order."""
        from dflash_jax.drafter.api import with_attention_impl

        cfg = drafter.config
        if tuple(cfg.target_layer_ids) != self.layer_ids:
            raise ValueError(
                f"replay: the drafter taps target layers {tuple(cfg.target_layer_ids)}, the held-out "
                f"features were taken at {self.layer_ids}"
            )
        if self._rows is None:
            self._rows = self._prepare()
        drafter = with_attention_impl(drafter, "xla")  # any device, the kernel's own tests aside
        t_graph, t_state = nnx.split(self.target)
        d_graph, d_state = nnx.split(drafter)
        S = cfg.block_size
        outs = []
        for b0, ids, feats, seg, anchors, valid in self._rows:
            drafts = np.asarray(
                jax.device_get(
                    _draft_every_position(t_graph, t_state, d_graph, d_state, ids, feats, seg, anchors, valid)
                )
            )
            batch = zip(self.prompts[b0 : b0 + len(drafts)], self.answers[b0 : b0 + len(drafts)], strict=True)
            for r, (p, a) in enumerate(batch):
                outs.append(
                    walk(
                        len(p),
                        a,
                        drafts[r],
                        max_new_tokens=self.max_new_tokens,
                        block_size=S,
                        stop_token_ids=self.stop_token_ids,
                    )
                )
        return outs


__all__ = ["Replay", "walk"]
