"""Regenerating chat replies with the target model itself.

DFlash drafters learn to predict the *target's* continuations, so training data is remade by
answering each prompt with the target (greedy or sampled), KV-cached and batched in JAX
(``decoding.generate``). Used by ``python -m dflash_jax.regenerate`` and the training run's
regeneration cache (``training.regen_cache``). :func:`dataset_replies` picks the same prompts and
keeps the data's own first reply instead (no generation): the labels are still the target's argmax
over that text, and a forward pass over it costs far less than decoding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from dflash_jax.data import sources
from dflash_jax.decoding.generate import generate
from dflash_jax.decoding.prompts import encode_prompt, stop_token_ids
from dflash_jax.decoding.sampling import SamplingConfig


@dataclass
class RegenReport:
    prompts_seen: int = 0
    written: int = 0
    skipped_long: int = 0
    skipped_no_user: int = 0
    stopped_at_eos: int = 0
    empty: int = 0
    answered_by: str = "target"  # "dataset": the data's own replies were kept, nothing generated

    def summary(self) -> str:
        what = "regenerated" if self.answered_by == "target" else "kept the data's own reply for"
        return (
            f"{what} {self.written} responses from {self.prompts_seen} prompts "
            f"({self.stopped_at_eos} ended with EOS; skipped: {self.skipped_long} prompts over the length "
            f"limit, {self.skipped_no_user} without a user turn, {self.empty} empty answers)"
        )


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
) -> tuple[list[dict], list[list[int]]]:
    """Answers encoded prompts ``(record id, messages, token ids)`` with the target. Returns the
    records (prompt + one assistant turn; an empty answer is left out and counted in ``report``)
    and every answer's tokens as generated, a final stop token included."""
    eos = stop_token_ids(target.config, tokenizer)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not show_progress)
    outs = generate(
        target,
        [ids for _, _, ids in prompts],
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos,
        sampling=sampling,
        batch_size=batch_size,
        seed=seed,
        progress=bar.update,
    )
    bar.close()
    result = []
    for (rec_id, msgs, _), toks in zip(prompts, outs, strict=True):
        if toks and toks[-1] in eos:
            report.stopped_at_eos += 1
            toks = toks[:-1]
        text = tokenizer.decode(toks, skip_special_tokens=True)
        if not text.strip():
            report.empty += 1
            continue
        result.append({"id": rec_id, "messages": [*msgs, {"role": "assistant", "content": text}]})
    return result, outs


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


__all__ = ["RegenReport", "read_records", "regenerate_records"]
