"""Tau by replay (``decoding/replay.py``) against real greedy speculative decoding.

The reference is the speculative decoder itself (``decoding.evaluate`` with ``exact_tail=False``, as
the training run measures tau): replaying the target's greedy answers must give every prompt the
same verify steps, the same tokens produced per step and the same drafts accepted.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import save_hf_model

import dflash_jax
from dflash_jax.decoding.evaluation import acceptance_stats, evaluate
from dflash_jax.decoding.generate import generate
from dflash_jax.decoding.replay import Replay, walk
from dflash_jax.drafter.api import init_drafter, set_draft_vocab
from dflash_jax.drafter.config import DrafterConfig

M = 24  # new tokens


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return dflash_jax.load_target(save_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_replay"), seed=5))


def test_walk_follows_the_decoders_accounting():
    # S=4, answer y0..y6 with a stop at y6; drafts at y0 hit y1, y2 then miss; at y3 hit all three.
    y = [10, 11, 12, 13, 14, 15, 99]
    drafts = np.full((7, 3), -1)
    drafts[0] = [11, 12, 0]
    drafts[3] = [14, 15, 99]
    out = walk(5, y, drafts, max_new_tokens=16, block_size=4, stop_token_ids=[99])
    assert out.acceptance_lengths == [3, 3] and out.accepted == [2, 3] and out.drafted == [3, 3]
    assert out.output_ids == y and out.stopped
    # the length limit: 5 new tokens, the second step verifies 2 slots and produces 1
    out = walk(5, y[:5], drafts, max_new_tokens=5, block_size=4)
    assert out.acceptance_lengths == [3, 1] and out.accepted == [2, 1] and out.drafted == [3, 1]
    assert out.output_ids == y[:5] and not out.stopped
    with pytest.raises(ValueError, match="ends without a stop token before max_new_tokens=16"):
        walk(5, y[:5], drafts, max_new_tokens=16, block_size=4)


@pytest.mark.parametrize("block_size", [4, 3])
def test_replay_equals_speculative_decoding(target, block_size):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 7, 13, 31, 5, 11, 26, 3)]
    plain = generate(target, prompts, max_new_tokens=M, batch_size=8)
    counts = np.bincount(np.concatenate(plain), minlength=512)
    # a stop token the target emits mid-answer in some prompts (so some answers end early), and a
    # draft vocabulary of the target's favourite tokens, so drafts hit often
    by_count = np.argsort(counts, kind="stable")[::-1]
    stop = int(by_count[5])
    answers = generate(target, prompts, max_new_tokens=M, eos_token_ids=[stop], batch_size=8)
    assert any(len(a) < M for a in answers) and any(len(a) == M for a in answers)
    vocab = np.sort(by_count[:3])
    cfg = DrafterConfig.for_target(
        target.config, num_layers=1, mask_token_id=7, block_size=block_size, draft_vocab_size=3
    )
    drafter = set_draft_vocab(init_drafter(cfg, target, 2), vocab)

    real = evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=M,
        stop_token_ids=[stop],
        batch_size=2,
        baseline=False,
        warmup=False,
        exact_tail=False,
    )["prompts"]
    replay = Replay(
        target,
        prompts,
        answers,
        layer_ids=cfg.target_layer_ids,
        max_new_tokens=M,
        stop_token_ids=[stop],
        batch_size=2,
    )
    ours = replay.outputs(drafter)
    assert [o.output_ids for o in ours] == [r["output_ids"] for r in real] == answers
    assert [o.acceptance_lengths for o in ours] == [r["acceptance_lengths"] for r in real]
    for o, r in zip(ours, real, strict=True):
        # a draft matching the target *after* the stop token counts for the decoder, not for replay
        last = len(o.accepted) - 1 if o.stopped else len(o.accepted)
        assert o.accepted[:last] == r["accepted"][:last]
    accepted = [a for o in ours for a in o.accepted]
    assert sum(a > 0 for a in accepted) >= 5, accepted  # the comparison has accepted drafts in it
    stats = acceptance_stats(ours, block_size)
    assert stats["tau"] > 1.0 and stats["num_steps"] == sum(len(r["acceptance_lengths"]) for r in real)
    assert replay.outputs(drafter)[0].acceptance_lengths == ours[0].acceptance_lengths  # features kept


def test_replay_refuses_answers_it_cannot_replay(target):
    cfg = DrafterConfig.for_target(target.config, num_layers=1, mask_token_id=7, block_size=4)
    with pytest.raises(ValueError, match="2 prompts but 1 answers"):
        Replay(target, [[1], [2]], [[3]], layer_ids=cfg.target_layer_ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="answer 5 .*max_new_tokens=4"):
        Replay(target, [[1]], [[3] * 5], layer_ids=cfg.target_layer_ids, max_new_tokens=4)
    replay = Replay(target, [[1]], [[3]], layer_ids=(0,), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"held-out features were taken at \(0,\)"):
        replay.outputs(init_drafter(cfg, target, 0))
