"""Regenerating chat replies with the target model itself.

DFlash drafters learn to predict the *target's* continuations, so training data is remade by
answering each prompt with the target (greedy or sampled): in this process, KV-cached and batched in
JAX (``decoding.generate``, :class:`InProcess`), or by an OpenAI-compatible server that serves the
target (``decoding.regen_server``, :class:`Server`), where later assistant turns can be answered too,
each given the regenerated history (``regen.turns: all``). :func:`regenerate_file` writes every
answer as it arrives and resumes a file by record id (``decoding.answer_log``). Used by
``python -m dflash_jax.regenerate`` and the training run's regeneration cache
(``training.regen_cache``). :func:`dataset_replies` picks the same prompts and keeps the data's own
first reply instead (no generation): the labels are still the target's argmax over that text, and a
forward pass over it costs far less than decoding it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

from tqdm import tqdm

from dflash_jax.data import sources
from dflash_jax.decoding.generate import generate
from dflash_jax.decoding.prompts import encode_prompt, stop_token_ids
from dflash_jax.decoding.sampling import SamplingConfig

log = logging.getLogger(__name__)


@dataclass
class RegenReport:
    prompts_seen: int = 0
    written: int = 0
    skipped_long: int = 0
    skipped_no_user: int = 0
    stopped_at_eos: int = 0
    empty: int = 0
    answered_by: str = "target"  # "dataset": the data's own replies were kept, nothing generated
    resumed: int = 0  # records already in a resumed file (in ``written``, not answered again)
    rejected: int = 0  # prompts a server refused (HTTP 400/413/422: e.g. over its context length)
    later_turns: int = 0  # assistant turns after the first answered (regen.turns: all)

    def summary(self) -> str:
        what = "regenerated" if self.answered_by == "target" else "kept the data's own reply for"
        extra = f", {self.rejected} refused by the server" if self.rejected else ""
        resumed = f"; {self.resumed} of them were already in the resumed file" if self.resumed else ""
        turns = f"; {self.later_turns} later assistant turns answered too" if self.later_turns else ""
        return (
            f"{what} {self.written} responses from {self.prompts_seen} prompts "
            f"({self.stopped_at_eos} ended with EOS; skipped: {self.skipped_long} prompts over the length "
            f"limit, {self.skipped_no_user} without a user turn, {self.empty} empty answers{extra})"
            f"{resumed}{turns}"
        )


def reply_text(text: str, reasoning: str | None, keep_reasoning: bool) -> str:
    """An answer as a training reply: with ``keep_reasoning`` the reasoning a server returned apart
    goes in front as a ``<think>`` block (how chat templates render it and ``data.chat`` trains it);
    without, reasoning is dropped, both the separate one and an inline ``...</think>`` block."""
    if not keep_reasoning:
        return text.split("</think>")[-1].lstrip() if "</think>" in text else text
    if reasoning and reasoning.strip():
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
    return text


def _usable_prompts(records, tokenizer, max_prompt_tokens, enable_thinking, report):
    """-> [(record, prompt messages, prompt ids)] of the records with a user turn whose prompt fits."""
    kept = []
    for rec in records:
        if "messages" not in rec:
            raise sources.BadDataError(
                f"{rec.get('origin', rec.get('id'))}: a pre-tokenized row has no conversation to "
                "regenerate: train on it as it is (regen.enabled: false) or give chat records"
            )
        report.prompts_seen += 1
        msgs = sources.prompt_messages(rec["messages"])
        if not any(m["role"] == "user" for m in msgs):
            report.skipped_no_user += 1
            continue
        ids = encode_prompt(tokenizer, msgs, enable_thinking)
        if len(ids) > max_prompt_tokens:
            report.skipped_long += 1
            continue
        kept.append((rec, msgs, ids))
    return kept


def answer_prompts(
    target,
    tokenizer,
    prompts: Sequence[tuple[str, list[dict], list[int]]],
    *,
    report: RegenReport,
    max_new_tokens: int,
    batch_size: int,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    desc: str = "regenerate",
    show_progress: bool = True,
    keep_reasoning: bool = True,
    on_record: Callable[[dict], None] | None = None,
) -> tuple[list[dict], list[list[int]]]:
    """Answers encoded prompts ``(record id, messages, token ids)`` with the target. Returns the
    records (prompt + one assistant turn; an empty answer is left out and counted in ``report``)
    and every answer's tokens as generated, a final stop token included. ``on_record(record)`` is
    called for each record as soon as its batch is done."""
    eos = stop_token_ids(target.config, tokenizer)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not show_progress)
    records: list[dict | None] = [None] * len(prompts)

    def batch_done(indices, outs):
        for i, toks in zip(indices, outs, strict=True):
            rec_id, msgs, _ = prompts[i]
            if toks and toks[-1] in eos:
                report.stopped_at_eos += 1
                toks = toks[:-1]
            text = reply_text(tokenizer.decode(toks, skip_special_tokens=True), None, keep_reasoning)
            if not text.strip():
                report.empty += 1
                continue
            records[i] = {"id": rec_id, "messages": [*msgs, {"role": "assistant", "content": text}]}
            if on_record is not None:
                on_record(records[i])

    outs = generate(
        target,
        [ids for _, _, ids in prompts],
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos,
        sampling=sampling,
        batch_size=batch_size,
        seed=seed,
        progress=bar.update,
        on_batch=batch_done,
    )
    bar.close()
    return [r for r in records if r is not None], outs


def regenerate_records(
    target,
    tokenizer,
    records: Sequence[dict],
    *,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 512,
    batch_size: int = 16,
    sampling: SamplingConfig | None = None,
    enable_thinking: bool | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> tuple[list[dict], RegenReport]:
    """records: normalised ``{"id", "messages"}``; each is cut before its first assistant turn and
    answered by the target. Returns the new records (prompt + one assistant turn) and a report."""
    report = RegenReport()
    kept = _usable_prompts(records, tokenizer, max_prompt_tokens, enable_thinking, report)
    result, _ = answer_prompts(
        target,
        tokenizer,
        [(f"{rec['id']}", msgs, ids) for rec, msgs, ids in kept],
        report=report,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        sampling=sampling,
        seed=seed,
        show_progress=show_progress,
    )
    report.written = len(result)
    return result, report


@dataclass(frozen=True)
class InProcess:
    """``regen.backend: inprocess``: the target answers in this process, batched
    (``regen.batch_size``), the first assistant turn of each record."""

    target: object
    max_new_tokens: int
    batch_size: int
    sampling: SamplingConfig | None = None
    seed: int = 0
    show_progress: bool = True

    def answer(self, tokenizer, prompts, *, report, keep_reasoning, on_record) -> None:
        answer_prompts(
            self.target,
            tokenizer,
            [(f"{rec['id']}", msgs, ids) for rec, msgs, ids in prompts],
            report=report,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            sampling=self.sampling,
            seed=self.seed,
            show_progress=self.show_progress,
            keep_reasoning=keep_reasoning,
            on_record=on_record,
        )


def user_segments(messages: Sequence[dict]) -> list[list[dict]]:
    """A conversation's turns as the runs of non-assistant turns (system, user, tool) that an
    assistant answers, its own assistant turns left out: each run with a user turn is one segment,
    a run without one joins the next (``regen.turns: all`` answers after every segment)."""
    segments, pending = [], []
    for m in messages:
        if m["role"] == "assistant":
            if any(p["role"] == "user" for p in pending):
                segments.append(pending)
                pending = []
            continue
        pending.append({"role": m["role"], "content": m["content"]})
    if any(p["role"] == "user" for p in pending):
        segments.append(pending)
    return segments


@dataclass(frozen=True)
class Server:
    """``regen.backend: server``: an OpenAI-compatible server answers (``decoding.regen_server``),
    ``concurrency`` conversations at a time. With ``turns="all"`` every assistant turn of a
    conversation is answered in order, each given the regenerated history (one with tool turns at
    its first turn only); a conversation stops at a turn whose prompt passes ``max_prompt_tokens``
    or whose answer is empty."""

    server: object  # regen_server.ChatServer
    model: str
    max_new_tokens: int
    max_prompt_tokens: int
    concurrency: int
    turns: str = "first"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    enable_thinking: bool | None = None
    show_progress: bool = True

    @classmethod
    def connect(cls, regen, target_dir, tokenizer, enable_thinking, **decoding) -> Server:
        """The backend of ``regen`` (a ``RegenSection``) once ``regen_server.connect`` has checked
        that every URL serves the target: nothing is generated before that. ``decoding``: ``top_p``,
        ``seed``."""
        from dflash_jax.decoding.regen_server import connect

        server, model = connect(regen, target_dir, tokenizer, enable_thinking)
        return cls(
            server,
            model,
            max_new_tokens=regen.max_new_tokens,
            max_prompt_tokens=regen.max_prompt_tokens,
            concurrency=regen.concurrency,
            turns=regen.turns,
            temperature=regen.temperature,
            enable_thinking=enable_thinking,
            **decoding,
        )

    def _converse(self, tokenizer, rec, first, keep_reasoning) -> tuple[dict | None, dict]:
        rejected = self.server._openai.APIStatusError
        stats = {"stopped_at_eos": 0, "empty": 0, "rejected": 0, "later_turns": 0}
        # Tool results answer the original tool calls, which a regenerated history does not make:
        # a conversation with tool turns is answered at its first turn only.
        tools = any(m["role"] == "tool" for m in rec["messages"])
        segments = [first] if self.turns == "first" or tools else user_segments(rec["messages"])
        history: list[dict] = []
        for k, segment in enumerate(segments):
            history = history + segment
            if k and len(encode_prompt(tokenizer, history, self.enable_thinking)) > self.max_prompt_tokens:
                break
            try:
                ans = self.server.chat(
                    self.model,
                    history,
                    max_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                    top_p=self.top_p,
                    seed=self.seed,
                    enable_thinking=self.enable_thinking,
                )
            except rejected as e:
                if e.status_code not in (400, 413, 422):
                    raise
                log.warning("record %s: the server refused turn %d (%s)", rec["id"], k + 1, e)
                stats["rejected"] += k == 0
                break
            text = reply_text(ans.content, ans.reasoning, keep_reasoning)
            stats["stopped_at_eos"] += ans.stopped
            if not text.strip():
                stats["empty"] += 1
                break
            history.append({"role": "assistant", "content": text})
            stats["later_turns"] += k > 0
        if not any(m["role"] == "assistant" for m in history):
            return None, stats
        return {"id": f"{rec['id']}", "messages": history}, stats

    def answer(self, tokenizer, prompts, *, report, keep_reasoning, on_record) -> None:
        bar = tqdm(total=len(prompts), desc="regenerate", unit="prompt", disable=not self.show_progress)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="regen")
        todo, running = iter(prompts), set()
        try:
            while True:
                # A bounded queue: an interrupt leaves few requests in flight.
                for rec, msgs, _ in todo:
                    running.add(pool.submit(self._converse, tokenizer, rec, msgs, keep_reasoning))
                    if len(running) >= 2 * self.concurrency:
                        break
                if not running:
                    break
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    out, stats = fut.result()
                    for name, n in stats.items():
                        setattr(report, name, getattr(report, name) + n)
                    if out is not None:
                        on_record(out)
                    bar.update(1)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            bar.close()


# Backend fields that change how fast answers come, not what they are.
_NOT_ANSWER_SETTINGS = frozenset({"target", "server", "show_progress", "batch_size", "concurrency"})


def answer_settings(backend, **prompting) -> dict:
    """What decides a backend's answers, as JSON values: its kind and its dataclass fields but the
    ones in ``_NOT_ANSWER_SETTINGS``, with ``prompting`` (prompt length, thinking, reasoning)."""
    out = {"backend": type(backend).__name__, **prompting}
    for field in dataclasses.fields(backend) if dataclasses.is_dataclass(backend) else ():
        if field.name not in _NOT_ANSWER_SETTINGS:
            value = getattr(backend, field.name)
            out[field.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def regenerate_file(
    path,
    records: Sequence[dict],
    tokenizer,
    backend: InProcess | Server,
    *,
    resume: bool,
    max_prompt_tokens: int = 512,
    enable_thinking: bool | None = None,
    keep_reasoning: bool = True,
) -> RegenReport:
    """Answers ``records`` (normalised ``{"id", "messages"}``) with ``backend`` into the chat JSONL
    ``path``, each record appended as its answer arrives. ``resume``: keep the records already in
    ``path`` (by id; a torn last line is answered again) and answer only the others; otherwise
    ``path`` is started anew (the caller checked it may be replaced). When done the file is
    rewritten in the records' order (``decoding.answer_log``). A resume with other answer settings
    (:func:`answer_settings`) than the file was started with is refused. Returns the report;
    ``written`` counts the file's records, resumed ones included."""
    from dflash_jax.decoding.answer_log import AnswerLog

    report = RegenReport()
    kept = _usable_prompts(records, tokenizer, max_prompt_tokens, enable_thinking, report)
    order = [f"{rec['id']}" for rec, _, _ in kept]
    seen = set()
    for rec_id in order:
        if rec_id in seen:
            raise sources.BadDataError(
                f"record id {rec_id!r} is used by two prompts: a resumable output needs unique ids"
            )
        seen.add(rec_id)
    if not kept and not resume:
        return report  # nothing to answer: ``path`` is left as it was
    settings = answer_settings(
        backend,
        max_prompt_tokens=max_prompt_tokens,
        enable_thinking=enable_thinking,
        keep_reasoning=keep_reasoning,
    )
    with AnswerLog(path, resume=resume, settings=settings) as out:
        stray = [rec_id for rec_id in out.done if rec_id not in seen]
        if stray:
            raise sources.BadDataError(
                f"{path}: {len(stray)} records (e.g. {stray[0]!r}) are not among this run's prompts: "
                "it was made from other data or settings; resume it with those, or pass --overwrite"
            )
        report.resumed = len(out.done)
        todo = [p for p in kept if f"{p[0]['id']}" not in out.done]
        if todo:
            backend.answer(
                tokenizer, todo, report=report, keep_reasoning=keep_reasoning, on_record=out.append
            )
        report.written = out.finish(order)
    return report


def dataset_replies(
    tokenizer,
    records: Sequence[dict],
    *,
    max_prompt_tokens: int = 512,
    enable_thinking: bool | None = None,
) -> tuple[list[dict], RegenReport]:
    """The prompts :func:`regenerate_records` would answer (same filters), each with the first
    assistant reply the record already has; a record without one (or with an empty one) counts as an
    empty answer. Returns (prompt + that reply) records and a report."""
    report = RegenReport(answered_by="dataset")
    result = []
    for rec, msgs, _ in _usable_prompts(records, tokenizer, max_prompt_tokens, enable_thinking, report):
        rest = rec["messages"][len(msgs) :]
        if not rest or not rest[0]["content"].strip():
            report.empty += 1
            continue
        result.append(
            {"id": f"{rec['id']}", "messages": [*msgs, {"role": "assistant", "content": rest[0]["content"]}]}
        )
    report.written = len(result)
    return result, report


def read_records(source: str | Sequence[str], limit: int | None, on_bad_record: str = "skip") -> list[dict]:
    """The first ``limit`` normalised records of chat sources (paths or 'sharegpt', read in
    order), bad ones skipped."""
    from dflash_jax.data.pipeline import DataConfig, load_index

    sources_ = (source,) if isinstance(source, str) else tuple(source)
    cfg = DataConfig(sources=sources_, max_records=limit, on_bad_record=on_bad_record)
    index, _ = load_index(cfg)
    src = sources.RecordSource(index)
    try:
        return [src[i] for i in range(len(src))]
    finally:
        src.close()


__all__ = [
    "InProcess",
    "RegenReport",
    "Server",
    "answer_settings",
    "read_records",
    "regenerate_file",
    "regenerate_records",
]
