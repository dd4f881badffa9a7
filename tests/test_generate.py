"""KV-cache generation and regeneration vs transformers' greedy generate."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import make_hf_model, prompt_ids

import dflash_jax
from dflash_jax.data.pipeline import DataConfig, make_train_iterator
from dflash_jax.decoding.generate import _generate_batch, generate
from dflash_jax.decoding.regeneration import dataset_replies, regenerate_records
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.regenerate import main as regenerate_main


def hf_greedy(model, prompt, max_new_tokens, eos):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["qwen3", "llama3", "qwen2"])
def test_greedy_matches_transformers_on_tiny_targets(kind, tmp_path):
    hf = make_hf_model(kind, seed=21)
    hf.save_pretrained(tmp_path)
    target = dflash_jax.load_target(tmp_path)
    # Prompts of different lengths in one batch (right padding), one long enough for RoPE.
    prompts = [prompt_ids(n, 512, seed=n)[0].tolist() for n in (3, 40, 97, 300)]
    eos = int(np.argsort(np.bincount(prompts[2], minlength=512))[-1])  # a token that does occur
    ours = generate(target, prompts, max_new_tokens=24, eos_token_ids=(eos,), batch_size=4)
    for p, o in zip(prompts, ours, strict=True):
        assert o == hf_greedy(hf, p, 24, eos)


def test_sampling_is_seeded_and_respects_top_k(tmp_path):
    hf = make_hf_model("qwen3", seed=22)
    hf.save_pretrained(tmp_path)
    target = dflash_jax.load_target(tmp_path)
    prompts = [prompt_ids(20, 512, seed=1)[0].tolist()] * 2
    cfg = SamplingConfig(temperature=1.0, top_k=1)
    # top_k=1 sampling is greedy decoding.
    assert generate(target, prompts, max_new_tokens=12, sampling=cfg) == generate(
        target, prompts, max_new_tokens=12
    )
    hot = SamplingConfig(temperature=2.0)
    a = generate(target, prompts, max_new_tokens=12, sampling=hot, seed=5)
    b = generate(target, prompts, max_new_tokens=12, sampling=hot, seed=5)
    c = generate(target, prompts, max_new_tokens=12, sampling=hot, seed=6)
    assert a == b and a != c
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from convert.smollm2 import smollm2_dir

    path = smollm2_dir()
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def test_regeneration_matches_transformers_on_smollm2(smollm2, tmp_path):
    path, tok, hf = smollm2
    target = dflash_jax.load_target(path)
    records = [
        {"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {
            "id": "b",
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name three primary colours."},
                {"role": "assistant", "content": "(old answer, replaced)"},
            ],
        },
        {"id": "c", "messages": [{"role": "assistant", "content": "no user turn: skipped"}]},
    ]
    out, report = regenerate_records(
        target, tok, records, max_new_tokens=20, batch_size=2, show_progress=False
    )
    assert report.written == 2 and report.skipped_no_user == 1
    for rec, new in zip(records[:2], out, strict=True):
        prompt_msgs = [m for m in rec["messages"] if m["role"] != "assistant"]
        ids = tok.apply_chat_template(prompt_msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ref = hf_greedy(hf, ids, 20, tok.eos_token_id)
        if ref and ref[-1] == tok.eos_token_id:
            ref = ref[:-1]
        assert new["messages"][:-1] == prompt_msgs
        assert new["messages"][-1] == {
            "role": "assistant",
            "content": tok.decode(ref, skip_special_tokens=True),
        }


def test_dataset_replies_keep_the_first_reply_of_the_prompts_regeneration_would_answer(qwen):
    """regen.answers=dataset: the prompts regenerate_records answers (same filters), each with the
    record's own first reply; nothing is generated."""

    def msg(role, text):
        return {"role": role, "content": text}

    records = [
        {
            "id": "a",
            "messages": [
                msg("user", "Hi?"),
                msg("assistant", "first"),
                msg("user", "And?"),
                msg("assistant", "second"),
            ],
        },
        {
            "id": "b",
            "messages": [msg("system", "Be brief."), msg("user", "Colours?"), msg("assistant", "Red.")],
        },
        {"id": "c", "messages": [msg("assistant", "no user turn")]},
        {"id": "d", "messages": [msg("user", "No reply yet.")]},
        {"id": "e", "messages": [msg("user", "word " * 300), msg("assistant", "too long a prompt")]},
        {"id": "f", "messages": [msg("user", "Blank?"), msg("assistant", "  ")]},
    ]
    out, report = dataset_replies(qwen, records, max_prompt_tokens=64)
    assert out == [
        {"id": "a", "messages": [msg("user", "Hi?"), msg("assistant", "first")]},
        {
            "id": "b",
            "messages": [msg("system", "Be brief."), msg("user", "Colours?"), msg("assistant", "Red.")],
        },
    ]
    assert dataclasses.asdict(report) == dict(
        prompts_seen=6,
        written=2,
        skipped_long=1,
        skipped_no_user=1,
        stopped_at_eos=0,
        empty=2,
        answered_by="dataset",
        resumed=0,
        rejected=0,
        later_turns=0,
    )
    assert report.summary().startswith("kept the data's own reply for 2 responses from 6 prompts")


def test_regenerate_cli_writes_data_the_pipeline_reads(smollm2, tmp_path):
    path, tok, _ = smollm2
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]})
            for q in ("Say hello.", "Count to three.", "What colour is the sky?")
        )
    )
    out = tmp_path / "regen.jsonl"
    assert (
        regenerate_main(
            [
                "--config",
                "tiny",
                f"target.path={path}",
                "target.tokenizer=null",
                f"data.sources={src}",
                "regen.max_new_tokens=12",
                "regen.batch_size=4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    it = make_train_iterator(
        DataConfig(
            sources=(str(out),), max_length=128, batch_size=2, num_epochs=1, shuffle=False, prefetch=0
        ),
        tok,
    )
    batch = next(it)
    assert batch["loss_mask"].sum() > 0


def _while_bodies(hlo_text: str) -> dict[str, list[str]]:
    """Optimized HLO text -> {while-body computation name: its instruction lines}."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    comps, name = {}, None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = line.split()[0].lstrip("%")
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line.strip())
    return {k: v for k, v in comps.items() if k in bodies}


def test_decoding_step_writes_only_the_new_tokens_of_the_cache(tmp_path):
    """Each decoding step scatters its new K/V into the cache and touches nothing else of that size:
    the layer scan once returned every layer's whole buffer (and was fed [L, 1, ...] reshapes), so
    XLA copied the entire cache and all weights on every step (BENCHMARKS.md "Decoding and regeneration")."""
    hf = make_hf_model("qwen3", seed=21)
    hf.save_pretrained(tmp_path)
    target = dflash_jax.load_target(tmp_path)
    c = target.config
    B, P, M = 4, 16, 8
    graph, state = nnx.split(target)

    def run(state, ids, lengths, eos, key):
        return _generate_batch(
            nnx.merge(graph, state), ids, lengths, eos, key, max_new_tokens=M, sampling=SamplingConfig()
        )

    hlo = (
        jax.jit(run)
        .lower(
            state,
            jnp.zeros((B, P), jnp.int32),
            jnp.full((B,), P, jnp.int32),
            jnp.asarray([-1]),
            jax.random.key(0),
        )
        .compile()
        .as_text()
    )
    cache_dims = [c.num_layers, B, P + M, c.num_kv_heads, c.head_dim]
    result = re.compile(r"^(?:ROOT )?%?(?P<name>[\w.\-]+) = f32\[(?P<dims>[\d,]*)\]\S* (?P<kind>[\w\-]+)\(")
    writers = []
    for body in _while_bodies(hlo).values():
        for line in body:
            m = result.match(line)
            if not m or m["kind"] in ("parameter", "get-tuple-element", "bitcast"):
                continue
            dims = [int(d) for d in m["dims"].split(",") if d and d != "1"]
            if dims == cache_dims:
                writers.append((m["name"], m["kind"]))
    scatters = [w for w in writers if "scatter" in w[0] or w[1] == "scatter"]
    assert len(scatters) == 2, writers  # K and V of the decoding loop
    assert scatters == writers, f"whole-cache copies in a decoding loop: {writers}"
