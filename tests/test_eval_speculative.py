"""Speculative decoding (dflash_jax.decoding.speculative / .evaluation) against z-lab's reference and
plain greedy.

The tiny target is a random transformers Qwen3 whose lm_head row for token C points along its mean
final hidden state, so C is its greedy choice most of the time; the drafter's mask token is picked
so that a lightly initialised drafter mostly predicts C too. Acceptance then varies between 1 and
the whole block (a random target/drafter pair accepts nothing, which would leave the accounting of
accepted drafts, the bonus token, cache cropping and the drafter context untested).

Cross-check: the same drafter exported to z-lab's format, loaded by
``dflash.model.DFlashDraftModel`` and run with ``dflash.model.dflash_generate`` on the transformers
target, must give the same tokens and the same per-step acceptance lengths as our batched JAX loop.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_fixtures import make_hf_model, prompt_ids
from target_families import biased_towards, favouring_mask_token

from dflash_jax.decoding.generate import generate
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.speculative import SpeculativeDecoder, speculative_generate
from dflash_jax.drafter.api import get_params, init_drafter
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.loading import load_drafter

torch = pytest.importorskip("torch")
dm = pytest.importorskip("dflash.model")

C = 7  # the token the biased target favours
ALPHA = 2.0  # strength of that bias
MAX_NEW = 24
PROMPT_LENS = (24, 9, 17, 30, 24, 5)


def _prompts():
    rows = prompt_ids(max(PROMPT_LENS), 512, seed=3, batch=len(PROMPT_LENS))
    return [rows[i, :n].tolist() for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """-> dict(hf=torch target, target=our target, dir, mask=mask token id, prompts)."""
    import dflash_jax

    hf = make_hf_model("qwen3")
    prompts = _prompts()
    biased_towards(hf, prompts, C, ALPHA)
    mask = favouring_mask_token(hf, C)
    d = tmp_path_factory.mktemp("biased_target")
    hf.save_pretrained(d)
    target = dflash_jax.load_target(d)
    return dict(hf=hf, target=target, dir=d, mask=mask, prompts=prompts)


def _drafter(setup, seed=0, **kw):
    base = dict(num_layers=1, mask_token_id=setup["mask"], block_size=4, target_layer_ids=(0, 2))
    base.update(kw)
    cfg = DrafterConfig.for_target(setup["target"].config, **base)
    return init_drafter(cfg, setup["target"], seed)


def _zlab(drafter, directory: Path):
    from convert.zlab_drafter import write_zlab_drafter

    write_zlab_drafter(directory, drafter.config, jax.device_get(get_params(drafter)), dtype="float32")
    return dm.DFlashDraftModel.from_pretrained(directory, dtype=torch.float32).eval()


def _zlab_generate(model, hf, prompts, *, stop=None, block_size=None, monkeypatch):
    # dflash_generate times itself with torch.cuda.synchronize when return_stats=True: CPU clock here.
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)
    out = []
    for p in prompts:
        r = dm.dflash_generate(
            model, hf, torch.tensor(p)[None], MAX_NEW, stop, block_size=block_size, return_stats=True
        )
        out.append((r.output_ids[0, len(p) :].tolist(), list(r.acceptance_lengths)))
    return out


# Two drafter layers (sliding window shorter than the prompts, then full attention); the drafter
# config says block size 4, decoding overrides it to 5 (as z-lab's ``block_size=`` argument does).
# Seed 7 gives both long accepted runs and a stop token inside one (checked below).
SLIDING = dict(
    num_layers=2,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=6,
    target_layer_ids=(0, 1, 2),
    seed=7,
)
BLOCK = 5


@pytest.mark.parametrize("stop", [None, (C,)], ids=["no-stop", "stop-at-C"])
def test_matches_zlab_dflash_generate_and_plain_greedy(setup, stop, tmp_path, monkeypatch):
    drafter = _drafter(setup, **SLIDING)
    prompts = setup["prompts"]
    ref = _zlab_generate(
        _zlab(drafter, tmp_path / "zlab"),
        setup["hf"],
        prompts,
        stop=list(stop) if stop else None,
        block_size=BLOCK,
        monkeypatch=monkeypatch,
    )
    ours = speculative_generate(
        setup["target"],
        drafter,
        prompts,
        max_new_tokens=MAX_NEW,
        stop_token_ids=stop or (),
        block_size=BLOCK,
        batch_size=4,  # two batches, the second with padding rows
    )
    for i, ((ref_ids, ref_acc), o) in enumerate(zip(ref, ours, strict=True)):
        assert o.output_ids == ref_ids, f"prompt {i}: tokens differ from z-lab"
        assert o.acceptance_lengths == ref_acc, f"prompt {i}: per-step acceptance differs from z-lab"
        # Near the length limit the block shrinks to min(S, max_len - start) slots (z-lab's verify_size).
        done = np.cumsum([0, *o.acceptance_lengths])[: o.num_steps]
        assert o.drafted == [min(BLOCK - 1, MAX_NEW - 1 - int(d)) for d in done]

    # Lossless (invariant 8): exactly the target's plain greedy decoding.
    plain = generate(setup["target"], prompts, max_new_tokens=MAX_NEW, eos_token_ids=stop or (), batch_size=4)
    assert [o.output_ids for o in ours] == plain

    steps = Counter(a for o in ours for a in o.acceptance_lengths)
    if stop:
        assert any(o.stopped for o in ours) and not all(o.stopped for o in ours)
        # some step accepted drafts past the stop token and was cut there
        assert any(a + 1 > p for o in ours for a, p in zip(o.accepted, o.acceptance_lengths, strict=True))
    else:
        assert steps[1] > 0 and sum(n for a, n in steps.items() if a >= 3) > 0, steps
        assert any(min(o.drafted) < BLOCK - 1 for o in ours)  # the shortened tail blocks were used
        # exact_tail=False drafts full blocks to the end: same tokens, no extra compiles.
        fast = SpeculativeDecoder(setup["target"], drafter, block_size=BLOCK, exact_tail=False)
        assert [o.output_ids for o in fast.generate(prompts, max_new_tokens=MAX_NEW, batch_size=4)] == plain


def test_sampling_is_lossless_in_distribution(setup):
    """Temperature > 0: the emitted tokens follow the target's own filtered distribution.

    x1 comes from the prefill, x2 and x3 from the acceptance rule (kept drafts, residual samples,
    or the bonus after an accepted draft). top_k=2 keeps the joint to 8 cells; the drafter agrees
    with the target often but not always, so acceptances and rejections both happen (checked).
    """
    target, prompt = setup["target"], setup["prompts"][2]
    drafter = _drafter(setup)
    sampling = SamplingConfig(temperature=1.0, top_k=2)
    n = 1024
    outs = SpeculativeDecoder(target, drafter, sampling=sampling).run_batch(
        [prompt] * n, max_new_tokens=3, batch_size=n, key=jax.random.key(100)
    )
    got = Counter(tuple(o.output_ids) for o in outs)
    first = Counter(o.accepted[0] for o in outs)
    assert first[0] > 0 and first[1] + first[2] > 0, first

    # Exact joint from the transformers target: filtered softmax after each prefix.
    def top2(ids):
        with torch.no_grad():
            logits = setup["hf"](torch.tensor(ids)[None]).logits[0, -1].double()
        v, i = torch.topk(logits, 2)
        return dict(zip(i.tolist(), torch.softmax(v, -1).tolist(), strict=True))

    exact = {}
    for x1, p1 in top2(prompt).items():
        for x2, p2 in top2(prompt + [x1]).items():
            for x3, p3 in top2(prompt + [x1, x2]).items():
                exact[(x1, x2, x3)] = p1 * p2 * p3
    assert set(got) <= set(exact)
    tv = 0.5 * sum(abs(got[k] / n - p) for k, p in exact.items())
    assert tv < 0.06, (tv, dict(got), exact)


def test_eval_cli_report(setup, tmp_path, capsys):
    """python -m dflash_jax.eval on input_ids prompts: JSON report consistent with itself."""
    from convert.zlab_drafter import write_zlab_drafter
    from dflash_jax import eval as ev

    drafter = _drafter(setup, **SLIDING)  # same shapes as above: compiled functions are reused
    hf_dir = tmp_path / "drafter"
    write_zlab_drafter(hf_dir, drafter.config, jax.device_get(get_params(drafter)), dtype="float32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n" for i, p in enumerate(setup["prompts"]))
    )
    out = tmp_path / "report.json"
    rc = ev.main(
        [
            "--config",
            "tiny",  # float32 target and drafter: the run's dtypes are the evaluator's
            f"target.path={setup['dir']}",
            "target.tokenizer=null",
            f"eval.drafter={hf_dir}",
            f"eval.prompts={prompts}",
            f"eval.max_new_tokens={MAX_NEW}",
            "eval.batch_size=4",
            f"eval.block_size={BLOCK}",
            "eval.attention_impl=xla",
            "eval.warmup=false",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert "tau" in capsys.readouterr().out
    report = json.loads(out.read_text())
    s, rows = report["summary"], report["prompts"]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(len(rows))]
    assert s["lossless"] and all(r["matches_baseline"] for r in rows)
    per_prompt = [np.mean(r["acceptance_lengths"]) for r in rows if r["acceptance_lengths"]]
    assert s["tau"] == pytest.approx(np.mean(per_prompt))
    assert s["tau_stderr"] == pytest.approx(np.std(per_prompt, ddof=1) / np.sqrt(len(per_prompt)))
    all_steps = [a for r in rows for a in r["acceptance_lengths"]]
    assert s["tau_pooled"] == pytest.approx(np.mean(all_steps)) and s["num_steps"] == len(all_steps)
    assert sum(s["histogram"]) == pytest.approx(1.0) and len(s["histogram"]) == s["block_size"] + 1
    assert sum(b * h for b, h in enumerate(s["histogram"])) == pytest.approx(s["tau_pooled"])
    assert s["tau"] > 1.0
    assert s["target_forwards"] == sum(1 + r["num_steps"] for r in rows)
    assert s["target_forward_speedup"] == pytest.approx(s["output_tokens"] / s["target_forwards"])
    pos = s["per_position_acceptance"]
    accepted = [a for r in rows for a in r["accepted"]]
    assert len(pos) == s["block_size"] - 1 and pos[0] == pytest.approx(np.mean([a >= 1 for a in accepted]))
    assert s["conditional_acceptance"][0] == pos[0] and 0 < pos[0] < 1
    for r in rows:  # each prompt: MAX_NEW tokens = 1 (prefill) + what the steps produced
        assert len(r["output_ids"]) == 1 + sum(r["acceptance_lengths"]) == MAX_NEW


def test_eval_rejects_bad_drafter_before_running(setup, tmp_path, capsys):
    from convert.zlab_drafter import param_shapes, unflatten, write_zlab_drafter
    from dflash_jax import eval as ev

    cfg = DrafterConfig.for_target(
        setup["target"].config, num_layers=1, mask_token_id=1, block_size=4, target_layer_ids=(0, 2)
    ).replace(hidden_size=32, intermediate_size=48, head_dim=16)
    rng = np.random.default_rng(0)
    params = unflatten({k: rng.normal(size=v).astype(np.float32) for k, v in param_shapes(cfg).items()})
    hf_dir = write_zlab_drafter(tmp_path / "bad", cfg, params, dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    rc = ev.main(
        [
            "--config",
            "tiny",
            f"target.path={setup['dir']}",
            f"eval.drafter={hf_dir}",
            f"eval.prompts={prompts}",
        ]
    )
    assert rc == 2
    assert "hidden_size=32" in capsys.readouterr().err


def test_load_prompts_formats(tmp_path, qwen):
    """messages / prompt / input_ids lines; the chat template ends with the generation prompt."""
    from dflash_jax.decoding.evaluation import PromptError, load_prompts

    tok = qwen
    f = tmp_path / "p.jsonl"
    f.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hi there"}]}),
                json.dumps({"prompt": "Hi there"}),
                json.dumps(
                    {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "x"}]}
                ),
                json.dumps({"input_ids": [5, 6, 7]}),
            ]
        )
        + "\n"
    )
    got = load_prompts(f, tok, enable_thinking=False)
    assert [g["id"] for g in got] == ["a", "1", "2", "3"]
    assert got[0]["input_ids"] == got[1]["input_ids"] == got[2]["input_ids"]
    assert tok.decode(got[0]["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert got[3]["input_ids"] == [5, 6, 7]
    f.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(PromptError, match="needs a tokenizer"):
        load_prompts(f, None)
    f.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(PromptError, match=r"p.jsonl:1: needs one of"):
        load_prompts(f, tok)


# ------------------------------------------------------------------------------------------
# SmolLM2 + the demo-trained drafter (needs a trained checkpoint: slow, opt-in)
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_trained_drafter_matches_zlab(tmp_path, monkeypatch):
    """DFLASH_SMOLLM2_CKPT=<run dir or checkpoint dir of the demo run> pytest -m slow ...

    The exported drafter run by z-lab's dflash_generate on the transformers SmolLM2 must give the
    same tokens and per-step acceptance lengths as our evaluator, with real acceptances among
    them (a trained drafter accepts draft tokens; a random one accepts none).
    """
    ckpt = os.environ.get("DFLASH_SMOLLM2_CKPT")
    if not ckpt:
        pytest.skip("set DFLASH_SMOLLM2_CKPT to the demo run's checkpoint to run this")
    import transformers

    import dflash_jax
    from convert.drafter_to_hf import export
    from convert.smollm2 import smollm2_dir

    target_dir = smollm2_dir()
    target = dflash_jax.load_target(target_dir)
    drafter = load_drafter(ckpt, target)
    hf_dir = export(ckpt, tmp_path / "zlab", dtype="float32")
    zmodel = dm.DFlashDraftModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(target_dir)
    questions = [
        "What is the capital of France?",
        "Write a short poem about the sea.",
        "Explain what a hash table is.",
        "List three uses of copper.",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "input_ids") else p) for p in prompts]
    stop = sorted(set(target.config.eos_token_ids) | {tok.eos_token_id})
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)
    ours = speculative_generate(
        target, drafter, prompts, max_new_tokens=64, stop_token_ids=stop, batch_size=4
    )
    for p, o in zip(prompts, ours, strict=True):
        r = dm.dflash_generate(zmodel, hf, torch.tensor(p)[None], 64, stop, return_stats=True)
        assert o.output_ids == r.output_ids[0, len(p) :].tolist()
        assert o.acceptance_lengths == list(r.acceptance_lengths)
    accepted_steps = sum(a > 1 for o in ours for a in o.acceptance_lengths)
    assert accepted_steps >= 3, accepted_steps
