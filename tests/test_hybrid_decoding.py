"""Decoding with the Qwen3.5 hybrid target: greedy generation == transformers ``generate`` token for
token, and speculative decoding == plain greedy (lossless).

z-lab's ``dflash_generate`` runs on the transformers hybrid, but is not lossless there: transformers'
``LinearAttentionLayer.crop`` (5.24) rolls back the conv window only, never the recurrent state, so
after the first partly rejected block its target continues from the state of the whole block. Its
acceptance lengths are therefore compared with ours only up to and including that first partial
rejection (identical states until then); after it, plain greedy is the reference.

As in test_eval_speculative, the target's lm_head row for token C points along its mean final
hidden state, so acceptance varies between 1 and the whole block: partial rollbacks of the
recurrent state and conv window inside a verified block are exercised, not only full rejections.
"""

from __future__ import annotations

import time
from collections import Counter

import jax
import pytest
from hybrid_fixtures import make_hybrid_model
from target_families import biased_towards, favouring_mask_token, ragged_prompts

import dflash_jax
from dflash_jax.decoding.generate import generate
from dflash_jax.decoding.speculative import speculative_generate
from dflash_jax.drafter.api import get_params, init_drafter
from dflash_jax.drafter.config import DrafterConfig

torch = pytest.importorskip("torch")
dm = pytest.importorskip("dflash.model")

C = 7
MAX_NEW = 24
PROMPT_LENS = (24, 9, 30, 17)
BLOCK = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = make_hybrid_model("text", seed=2)
    prompts = ragged_prompts(PROMPT_LENS, seed=3)
    biased_towards(hf, prompts, C, alpha=1.5)
    mask = favouring_mask_token(hf, C)
    d = tmp_path_factory.mktemp("hybrid_biased")
    hf.save_pretrained(d)
    return dict(hf=hf, target=dflash_jax.load_target(d), mask=mask, prompts=prompts)


def test_greedy_generation_matches_transformers(setup):
    ours = generate(setup["target"], setup["prompts"], max_new_tokens=MAX_NEW, batch_size=2)
    for p, o in zip(setup["prompts"], ours, strict=True):
        with torch.no_grad():
            ref = (
                setup["hf"]
                .generate(
                    torch.tensor(p)[None],
                    max_new_tokens=MAX_NEW,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(p) :]
                .tolist()
            )
        assert o == ref
    assert any(Counter(o)[C] < len(o) for o in ours)  # not one repeated token everywhere


@pytest.mark.slow
def test_speculative_matches_zlab_and_plain_greedy(setup, tmp_path, monkeypatch):
    from convert.zlab_drafter import write_zlab_drafter

    cfg = DrafterConfig.for_target(
        setup["target"].config,
        num_layers=1,
        mask_token_id=setup["mask"],
        block_size=4,
        target_layer_ids=(0, 2, 3),
    )
    drafter = init_drafter(cfg, setup["target"], 7)
    write_zlab_drafter(tmp_path, drafter.config, jax.device_get(get_params(drafter)), dtype="float32")
    zlab = dm.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)
    prompts = setup["prompts"]
    ours = speculative_generate(
        setup["target"], drafter, prompts, max_new_tokens=MAX_NEW, block_size=BLOCK, batch_size=2
    )
    plain = generate(setup["target"], prompts, max_new_tokens=MAX_NEW, batch_size=2)
    assert [o.output_ids for o in ours] == plain  # lossless (invariant 8)
    for i, (p, o) in enumerate(zip(prompts, ours, strict=True)):
        r = dm.dflash_generate(
            zlab, setup["hf"], torch.tensor(p)[None], MAX_NEW, None, block_size=BLOCK, return_stats=True
        )
        theirs = list(r.acceptance_lengths)
        first_crop = next((k for k, a in enumerate(theirs) if a < BLOCK), len(theirs) - 1)
        assert o.acceptance_lengths[: first_crop + 1] == theirs[: first_crop + 1], f"prompt {i}"
        n = 1 + sum(theirs[: first_crop + 1])
        assert o.output_ids[:n] == r.output_ids[0, len(p) : len(p) + n].tolist(), f"prompt {i}"
    steps = Counter(a for o in ours for a in o.acceptance_lengths)
    # Full rejections, partial acceptances (rollback inside the block) and long runs all happened.
    assert steps[1] > 0 and sum(n for a, n in steps.items() if 1 < a < BLOCK) > 0, steps
