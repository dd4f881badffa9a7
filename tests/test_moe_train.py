"""A MoE target downstream: training end to end on configs/tiny-moe.yaml (a tiny Qwen3-MoE on an
expert-parallel mesh of the 8 simulated devices), and speculative decoding on a MoE target
(greedy == plain greedy == transformers' greedy)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from moe_fixtures import make_qwen3_moe
from target_families import biased_towards, ragged_prompts

import dflash_jax
from dflash_jax.decoding.generate import generate
from dflash_jax.decoding.speculative import speculative_generate
from dflash_jax.drafter.api import init_drafter
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.train import run
from dflash_jax.training.run_config import load_run_config

torch = pytest.importorskip("torch")

C = 7  # the token the biased target favours
PROMPT_LENS = (24, 9, 30, 17)
MAX_NEW = 20


def _train(tmp_path, steps, extra=()):
    cfg = load_run_config(
        "tiny-moe",
        [f"output_dir={tmp_path}", f"train.steps={steps}", "train.warmup_steps=1", "train.log_every=1",
         "data.max_records=60", "train.checkpoint_every=100", *extra],
    )  # fmt: skip
    out = run(cfg, quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return out, [r["loss"] for r in rows if r["split"] == "train"]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_5_moe"])
def test_tiny_moe_train_steps_on_eight_devices(family, tmp_path):
    """Two train steps of each MoE family with the experts split over fsdp x tensor (2 per
    device of 8)."""
    out, losses = _train(tmp_path, 2, [f"target.tiny_model_type={family}"])
    target = out["target"]
    assert out["step"] == 2 and target.config.model_type == family
    gate = target.moe.gate[...]
    assert len(gate.sharding.device_set) == 8 and gate.addressable_shards[0].data.shape[1] == 2
    assert len(losses) == 2 and np.all(np.isfinite(losses))


@pytest.mark.slow
def test_tiny_moe_trains_and_evaluates(tmp_path):
    out, losses = _train(tmp_path, 6, ["eval.num_prompts=2"])
    assert out["step"] == 6 and len(losses) == 6 and np.all(np.isfinite(losses))
    for when in ("before", "after"):
        rep = out[f"eval_{when}"]
        assert rep["num_prompts"] == 2 and rep["verify_steps"] > 0


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """A tiny HF Qwen3-MoE whose lm_head row C points along its mean final hidden state, so
    acceptance varies (partial rollbacks, not only full rejections)."""
    hf = make_qwen3_moe(seed=3)
    prompts = ragged_prompts(PROMPT_LENS, seed=4)
    biased_towards(hf, prompts, C, alpha=1.2)
    d = tmp_path_factory.mktemp("moe_biased")
    hf.save_pretrained(d)
    return hf, dflash_jax.load_target(d), prompts


def test_speculative_equals_greedy_on_moe_target(biased):
    hf, target, prompts = biased
    plain = generate(target, prompts, max_new_tokens=MAX_NEW, batch_size=2)
    for p, o in zip(prompts, plain, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor(p)[None], max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert o == ref
    cfg = DrafterConfig.for_target(
        target.config, num_layers=1, mask_token_id=C, block_size=4, target_layer_ids=(0, 2, 3)
    )
    drafter = init_drafter(cfg, target, 7)
    ours = speculative_generate(target, drafter, prompts, max_new_tokens=MAX_NEW, block_size=4, batch_size=2)
    assert [o.output_ids for o in ours] == plain  # lossless
    steps = Counter(a for o in ours for a in o.acceptance_lengths)
    assert steps[1] > 0 and sum(n for a, n in steps.items() if a > 1) > 0, steps
