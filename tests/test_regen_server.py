"""Regeneration written as it goes and resumed, through a real OpenAI-compatible server.

The fast tests check the append/resume logic (a torn last line, a damaged file, a resumed run equal
to an uninterrupted one) and the server checks' pure parts. The slow ones start transformers' own
OpenAI-compatible server (``transformers serve``) on SmolLM2-135M-Instruct: its greedy answers
against this process's, a regeneration killed mid-run and resumed, and servers of another model
refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_jax.config_io import ConfigError, from_dict
from dflash_jax.data.sources import BadDataError
from dflash_jax.decoding.answer_log import AnswerLog, read_answered, settings_path
from dflash_jax.decoding.regen_server import _same_model, target_names
from dflash_jax.decoding.regeneration import (
    InProcess,
    answer_settings,
    regenerate_file,
    reply_text,
    user_segments,
)
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.training.run_config import RegenSection

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Say hello in Spanish.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
    "What colour is the sky?",
)


def chat_records(questions=QUESTIONS):
    return [
        {
            "id": f"q{i}",
            "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "(old answer)"}],
        }
        for i, q in enumerate(questions)
    ]


class ScriptedBackend:
    """Answers each prompt with a text made from its id, in order; ``stop_after`` answers in, it
    raises as a kill would stop a run."""

    def __init__(self, stop_after=None):
        self.stop_after, self.asked = stop_after, []

    def answer(self, tokenizer, prompts, *, report, keep_reasoning, on_record):
        for n, (rec, msgs, _) in enumerate(prompts):
            if n == self.stop_after:
                raise KeyboardInterrupt
            self.asked.append(rec["id"])
            on_record(
                {"id": rec["id"], "messages": [*msgs, {"role": "assistant", "content": f"re {rec['id']}"}]}
            )


def test_resume_after_a_kill_redoes_only_the_torn_record_and_equals_a_clean_run(qwen, tmp_path):
    records = chat_records()
    clean, killed = tmp_path / "clean.jsonl", tmp_path / "killed.jsonl"
    report = regenerate_file(clean, records, qwen, ScriptedBackend(), resume=False)
    assert report.written == len(records)

    with pytest.raises(KeyboardInterrupt):
        regenerate_file(killed, records, qwen, ScriptedBackend(stop_after=3), resume=False)
    assert len(killed.read_text().splitlines()) == 3  # each answer was on disk as it came
    with open(killed, "a") as f:
        f.write('{"id": "q3", "messages": [{"role": "us')  # the kill cut the fourth write
    assert set(read_answered(killed)[0]) == {"q0", "q1", "q2"}

    again = ScriptedBackend()
    report = regenerate_file(killed, records, qwen, again, resume=True)
    assert again.asked == ["q3", "q4", "q5"]  # nothing answered twice, the torn one redone
    assert report.resumed == 3 and report.written == len(records)
    assert killed.read_bytes() == clean.read_bytes()

    # Without resume the file is started anew.
    regenerate_file(killed, records[:2], qwen, ScriptedBackend(), resume=False)
    assert [json.loads(x)["id"] for x in killed.read_text().splitlines()] == ["q0", "q1"]


def test_a_resume_with_other_answer_settings_is_refused_and_a_finished_file_keeps_none(qwen, tmp_path):
    records, out = chat_records(), tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate_file(out, records, qwen, ScriptedBackend(stop_after=2), resume=False, keep_reasoning=False)
    assert settings_path(out).is_file()  # kept while the file is incomplete
    with pytest.raises(BadDataError, match=r"keep_reasoning: False then, True now"):
        regenerate_file(out, records, qwen, ScriptedBackend(), resume=True, keep_reasoning=True)
    assert set(read_answered(out)[0]) == {"q0", "q1"}  # the refusal changed nothing
    report = regenerate_file(out, records, qwen, ScriptedBackend(), resume=True, keep_reasoning=False)
    assert report.resumed == 2 and report.written == len(records)
    assert not settings_path(out).exists()  # complete: nothing left to resume
    # The settings are the backend's dataclass fields, less those that only change the speed.
    one = InProcess(target=None, max_new_tokens=8, batch_size=4, sampling=SamplingConfig(temperature=0.5))
    other = dataclasses.replace(one, batch_size=16, show_progress=False)
    assert answer_settings(one) == answer_settings(other)
    assert answer_settings(one)["sampling"]["temperature"] == 0.5
    assert answer_settings(one) != answer_settings(dataclasses.replace(one, max_new_tokens=9))


def test_a_damaged_or_foreign_file_is_not_resumed(qwen, tmp_path):
    records = chat_records()
    out = tmp_path / "out.jsonl"
    regenerate_file(out, records[:3], qwen, ScriptedBackend(), resume=False)
    lines = out.read_text().splitlines()
    out.write_text("\n".join([lines[0], "not json", lines[2]]) + "\n")
    with pytest.raises(BadDataError, match=r"out.jsonl: line 2 is not a regenerated record"):
        regenerate_file(out, records, qwen, ScriptedBackend(), resume=True)
    # A whole last line that does not parse (a write cut after its newline) is dropped, not fatal.
    out.write_text("\n".join([lines[0], lines[1], "{broken"]) + "\n")
    assert set(read_answered(out)[0]) == {"q0", "q1"} and read_answered(out)[1] == len("{broken\n")
    with pytest.raises(BadDataError, match=r"not among this run's prompts"):
        regenerate_file(out, records[2:], qwen, ScriptedBackend(), resume=True)
    with (
        AnswerLog(tmp_path / "x.jsonl", resume=False) as log,
        pytest.raises(ValueError, match="written twice"),
    ):
        rec = {
            "id": "a",
            "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
        }
        log.append(rec)
        log.append(rec)


class EchoServer:
    """A stand-in for regen_server.ChatServer: answers with the conversation it was sent, so a test
    sees what history each turn was asked with; reasoning returned apart, as vLLM's parser does."""

    import openai as _openai

    def __init__(self):
        self.sent = []

    def chat(self, model, messages, **kw):
        from dflash_jax.decoding.regen_server import ServerAnswer

        self.sent.append([m["content"] for m in messages])
        return ServerAnswer(f"after {'/'.join(self.sent[-1])}", "thought", stopped=True, prompt_tokens=None)


def test_all_turns_are_answered_given_the_regenerated_history(qwen, tmp_path):
    from dflash_jax.decoding.regeneration import Server

    def turn(role, text):
        return {"role": role, "content": text}

    records = [
        {
            "id": "a",
            "messages": [
                turn("user", "u1"),
                turn("assistant", "old1"),
                turn("user", "u2"),
                turn("assistant", "old2"),
            ],
        },
        {"id": "b", "messages": [turn("user", "v1"), turn("assistant", "old"), turn("user", "v2")]},
    ]
    echo = EchoServer()
    backend = Server(
        echo, "m", max_new_tokens=4, max_prompt_tokens=256, concurrency=2, turns="all", show_progress=False
    )
    report = regenerate_file(tmp_path / "o.jsonl", records, qwen, backend, resume=False, keep_reasoning=False)
    assert report.written == 2 and report.later_turns == 2 and report.stopped_at_eos == 4
    out = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
    assert out["a"] == [
        turn("user", "u1"),
        turn("assistant", "after u1"),
        turn("user", "u2"),
        turn("assistant", "after u1/after u1/u2"),
    ]
    assert out["b"][-1] == turn("assistant", "after v1/after v1/v2")  # a trailing user turn is answered too
    assert sorted(echo.sent) == [["u1"], ["u1", "after u1", "u2"], ["v1"], ["v1", "after v1", "v2"]]

    first = Server(
        EchoServer(), "m", max_new_tokens=4, max_prompt_tokens=256, concurrency=1, show_progress=False
    )
    regenerate_file(tmp_path / "f.jsonl", records[:1], qwen, first, resume=False, keep_reasoning=True)
    (rec,) = map(json.loads, (tmp_path / "f.jsonl").read_text().splitlines())
    assert rec["messages"] == [
        turn("user", "u1"),
        turn("assistant", "<think>\nthought\n</think>\n\nafter u1"),
    ]


def test_turns_reasoning_and_model_names():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    assert user_segments(msgs) == [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}],
        [{"role": "user", "content": "u2"}],
        [{"role": "user", "content": "u3"}],
    ]
    assert (
        reply_text("Paris.", "The capital... ", keep_reasoning=True)
        == "<think>\nThe capital...\n</think>\n\nParis."
    )
    assert reply_text("Paris.", "The capital...", keep_reasoning=False) == "Paris."
    assert reply_text("<think>\nhm\n</think>\n\nParis.", None, keep_reasoning=False) == "Paris."
    snapshot = Path("/hub/models--Qwen--Qwen3-8B/snapshots/0123abc")
    assert {"Qwen/Qwen3-8B", "Qwen3-8B"} <= target_names(snapshot)
    assert _same_model("Qwen/Qwen3-8B", target_names("/models/qwen3-8b"))
    assert not _same_model("Qwen/Qwen3-4B", target_names(snapshot))


def test_server_settings_are_validated(tmp_path, capsys):
    from dflash_jax.regenerate import main

    assert main(["--config", "tiny", "--out", str(tmp_path / "o.jsonl"), "--resume", "--overwrite"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="regen.base_urls"):
        from_dict(RegenSection, {"backend": "server"}, "regen")
    with pytest.raises(ConfigError, match="not an http"):
        from_dict(RegenSection, {"backend": "server", "base_urls": "localhost:8000"}, "regen")
    with pytest.raises(ConfigError, match="regen.turns=all"):
        from_dict(RegenSection, {"turns": "all"}, "regen")
    one = from_dict(RegenSection, {"backend": "server", "base_urls": "http://h:1/v1"}, "regen")
    assert one.base_urls == ("http://h:1/v1",)


# --------------------------------------------------------------------------- a real server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def smollm2_dir():
    from convert.smollm2 import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def server(smollm2_dir):
    """``transformers serve`` on SmolLM2-135M-Instruct (float32, CPU) on a free port -> its /v1 URL."""
    port = _free_port()
    cli = Path(sys.executable).with_name("transformers")
    proc = subprocess.Popen(
        [str(cli), "serve", str(smollm2_dir), "--host", "127.0.0.1", "--port", str(port)]
        + ["--device", "cpu", "--dtype", "float32", "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"transformers serve did not start: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _regen(url, **kw):
    return from_dict(RegenSection, {"backend": "server", "base_urls": [url], "retries": 1, **kw}, "regen")


def _answers(path) -> dict[str, str]:
    return {
        r["id"]: r["messages"][-1]["content"] for r in map(json.loads, Path(path).read_text().splitlines())
    }


@pytest.mark.slow
def test_server_greedy_answers_match_in_process_and_resume(server, smollm2_dir, tmp_path, monkeypatch):
    """Both float32: the server's greedy answers are this process's token for token. The
    in-process backend is killed after its first batch and resumed too."""
    from transformers import AutoTokenizer

    import dflash_jax
    from dflash_jax.decoding import answer_log
    from dflash_jax.decoding.regen_server import connect
    from dflash_jax.decoding.regeneration import InProcess, Server

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    records = chat_records(QUESTIONS[:4])
    regen = _regen(server, max_new_tokens=8, concurrency=2)
    chat_server, model = connect(regen, smollm2_dir, tok, None)
    served = Server(chat_server, model, max_new_tokens=8, max_prompt_tokens=256, concurrency=2)
    regenerate_file(tmp_path / "server.jsonl", records, tok, served, resume=False)

    local = InProcess(
        dflash_jax.load_target(smollm2_dir), max_new_tokens=8, batch_size=2, show_progress=False
    )
    real_append, calls = answer_log.AnswerLog.append, []

    def append_then_die(self, rec):
        if len(calls) == 2:  # the second batch's first answer: a kill
            raise KeyboardInterrupt
        calls.append(rec["id"])
        real_append(self, rec)

    monkeypatch.setattr(answer_log.AnswerLog, "append", append_then_die)
    with pytest.raises(KeyboardInterrupt):
        regenerate_file(tmp_path / "local.jsonl", records, tok, local, resume=False)
    monkeypatch.setattr(answer_log.AnswerLog, "append", real_append)
    report = regenerate_file(tmp_path / "local.jsonl", records, tok, local, resume=True)
    assert report.resumed == 2 and report.written == 4

    theirs, ours = _answers(tmp_path / "server.jsonl"), _answers(tmp_path / "local.jsonl")
    assert sorted(theirs) == sorted(ours) == [r["id"] for r in records]
    agree = total = 0
    for rec_id in ours:
        a, b = (tok.encode(x, add_special_tokens=False) for x in (theirs[rec_id], ours[rec_id]))
        agree += sum(x == y for x, y in zip(a, b, strict=False))
        total += max(len(a), len(b))
    print(f"server vs in-process greedy: {agree}/{total} tokens agree")
    assert theirs == ours, f"{agree}/{total} tokens agree: {theirs} vs {ours}"


@pytest.mark.slow
def test_regenerate_killed_mid_run_resumes_to_the_records_of_a_clean_run(server, smollm2_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    args = [
        "--config",
        "tiny",
        f"target.path={smollm2_dir}",
        "target.tokenizer=null",
        f"data.sources={prompts}",
    ]
    args += [
        "regen.backend=server",
        f"regen.base_urls={server}",
        "regen.max_new_tokens=6",
        "regen.concurrency=1",
    ]
    killed, clean = tmp_path / "killed.jsonl", tmp_path / "clean.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_jax.regenerate", *args, "--out", str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).parents[1],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    deadline = time.monotonic() + 300
    while not (killed.is_file() and killed.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no answer appended within 300 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_killed = killed.read_text().count("\n")
    assert 2 <= n_killed < len(QUESTIONS), "the kill came after the run ended: nothing to resume"
    if killed.read_text().endswith("\n"):  # the kill fell between two writes: cut one as it might
        with open(killed, "a") as f:
            f.write('{"id": "q5", "messages": [{"ro')

    from dflash_jax.regenerate import main

    assert main([*args, "--out", str(killed)]) == 2  # refused: the file exists, no --resume
    assert main([*args, "--out", str(killed), "--resume"]) == 0
    assert main([*args, "--out", str(clean)]) == 0
    assert killed.read_bytes() == clean.read_bytes()
    assert len(clean.read_text().splitlines()) == len(QUESTIONS)


@pytest.mark.slow
def test_a_server_of_another_model_is_refused_before_any_prompt(server, smollm2_dir, qwen):
    from transformers import AutoTokenizer

    from dflash_jax.decoding.regen_server import ServerError, connect

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    with pytest.raises(
        ServerError, match=r"serves \['.*smollm2-135m-instruct'\], not regen.model=Qwen/Qwen3-8B"
    ):
        connect(_regen(server, model="Qwen/Qwen3-8B"), smollm2_dir, tok, None)
    with pytest.raises(ServerError, match=r"serves .*smollm2.*, not the run's target /models/Qwen3-8B"):
        connect(_regen(server), "/models/Qwen3-8B", tok, None)
    # The right name but another tokenizer and template: the probe's token count tells them apart.
    with pytest.raises(
        ServerError, match=r"reads a probe conversation as \d+ prompt tokens, the run's tokenizer"
    ):
        connect(_regen(server), smollm2_dir, qwen, False)


def test_the_regeneration_cache_key_ignores_how_answers_are_fetched(tmp_path):
    """Another server address or concurrency keeps a run's cached (and partial) answers; another
    backend or turn setting does not."""
    from dflash_jax.training.regen_cache import regen_key
    from dflash_jax.training.run_config import load_run_config

    (tmp_path / "config.json").write_text("{}")
    tok = type("Tok", (), {"name_or_path": "tok", "chat_template": "{{ x }}", "__len__": lambda self: 10})()

    def key(*overrides):
        return regen_key(load_run_config("demo", ["regen.backend=server", *overrides]), tok, tmp_path)

    base = key("regen.base_urls=http://a:1/v1")
    assert (
        key("regen.base_urls=[http://b:2/v1,http://c:3/v1]", "regen.concurrency=64", "regen.retries=9")
        == base
    )
    assert key("regen.base_urls=http://a:1/v1", "regen.timeout_s=5") == base
    assert key("regen.base_urls=http://a:1/v1", "regen.turns=all") != base
    assert key("regen.base_urls=http://a:1/v1", "regen.keep_reasoning=false") != base
    assert regen_key(load_run_config("demo", []), tok, tmp_path) != base
