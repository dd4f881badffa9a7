"""The evaluation harness behind ``python -m dflash_jax.eval``: prompts in, decoding, metrics out.

``load_prompts`` reads a prompts JSONL, one prompt per line, any of

  {"messages": [{"role": "user", "content": "..."}, ...]}   chat (template applied; turns up to
                                                            the first assistant reply are kept)
  {"prompt": "..."} or {"question": "..."}                  a user message (template applied)
  {"turns": ["...", "..."]}                                 user messages asked one after another,
                                                            each after the target's answer to the
                                                            one before (z-lab's benchmark files)
  {"input_ids": [1, 2, 3]}                                  pre-tokenized, used as is

with an optional "id". Text prompts need a tokenizer.

``evaluate`` runs batched speculative decoding (``dflash_jax.decoding.speculative``) of token-id
prompts, greedy by default: lossless, so the output equals the target's own greedy decoding, which
it checks against the plain KV-cache decoder (``dflash_jax.decoding.generate``) unless
``baseline=False``. ``evaluate_conversations`` decodes ``load_prompts`` records (and the benchmark
sets of ``dflash_jax.decoding.benchmarks``) turn by turn, all conversations' turn t in one
``evaluate``: turn t+1 is asked after the speculative decoder's answer to turn t, decoded to text
as z-lab's benchmark does (the target's own greedy answer, since decoding is lossless); every turn
counts as one prompt of the report.

Reported (z-lab's benchmark conventions where it has one):

* ``tau``: mean acceptance length per verify step, counting the bonus token, averaged per prompt
  then over prompts (z-lab's "Average Acceptance length"); ``tau_pooled``: all produced tokens over
  all steps;
* ``histogram``: fraction of steps that produced b tokens, b = 0..S;
* ``per_position_acceptance[k-1]``: fraction of steps whose draft k was accepted, among steps that
  checked a draft k; ``conditional_acceptance``: the same among steps that accepted draft k-1;
* ``target_forward_speedup``: target forward passes of plain decoding (one per output token) over
  those of speculative decoding (prefill + one per step);
* ``tokens_per_s`` (speculative and baseline) and ``wall_speedup``, excluding compilation (a
  warm-up batch per prompt-length bucket runs first, unless ``warmup=False``).

Temperature > 0 samples with the standard speculative-sampling acceptance rule (lossless in
distribution, not token-for-token; no baseline comparison is made then).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from dflash_jax.decoding.prompts import bucket_length, encode_prompt, in_prompt_order, length_sorted_batches


class PromptError(ValueError):
    pass


# ------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------


def _chat_messages(obj: dict, where: str) -> list[dict]:
    """The turns of a chat prompt record up to the first assistant reply."""
    from dflash_jax.data.sources import BadRecordError, prompt_messages, record_turns

    try:
        out = prompt_messages(record_turns(obj, origin=where))
    except BadRecordError as e:
        raise PromptError(str(e)) from None
    if not out:
        raise PromptError(f"{where}: no turn before the first assistant reply")
    return out


def turns_of(obj: dict, where: str) -> list[str]:
    """The user messages of a ``{"turns": [...]}`` record, or :class:`PromptError` naming ``where``."""
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise PromptError(f"{where}: 'turns' must be a non-empty list of strings")
    return list(turns)


def load_prompts(
    path: str | Path, tokenizer=None, *, enable_thinking: bool | None = None, limit: int | None = None
) -> list[dict]:
    """Read a prompts JSONL (see module doc) -> ``[{"id", "input_ids"} or {"id", "turns"}]``
    (``turns`` records stay text: their later turns need the target's answers first).

    ``tokenizer`` may be a tokenizer or a zero-argument callable returning one (loaded only when a
    text prompt needs it). Errors name the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    tok_cache: list = []

    def get_tokenizer(where):
        if not tok_cache:
            tok = (
                tokenizer()
                if callable(tokenizer) and not hasattr(tokenizer, "apply_chat_template")
                else tokenizer
            )
            if tok is None:
                raise PromptError(
                    f"{where}: a text prompt needs a tokenizer (target.tokenizer), or use input_ids"
                )
            tok_cache.append(tok)
        return tok_cache[0]

    prompts = []
    with path.open() as f:
        for where, obj in jsonl_objects(path, f, limit):
            if "input_ids" in obj:
                ids = obj["input_ids"]
                if (
                    not isinstance(ids, list)
                    or not ids
                    or not all(isinstance(t, int) and t >= 0 for t in ids)
                ):
                    raise PromptError(f"{where}: 'input_ids' must be a non-empty list of non-negative ints")
                record = {"input_ids": [int(t) for t in ids]}
            elif "turns" in obj:
                record = {"turns": turns_of(obj, where)}
            elif "prompt" in obj or "question" in obj:
                field = "prompt" if "prompt" in obj else "question"
                if not isinstance(obj[field], str):
                    raise PromptError(f"{where}: {field!r} must be a string")
                msgs = [{"role": "user", "content": obj[field]}]
                record = {"input_ids": encode_prompt(get_tokenizer(where), msgs, enable_thinking)}
            elif "messages" in obj or "conversations" in obj:
                msgs = _chat_messages(obj, where)
                record = {"input_ids": encode_prompt(get_tokenizer(where), msgs, enable_thinking)}
            else:
                raise PromptError(
                    f"{where}: needs one of 'input_ids', 'prompt', 'question', 'messages', 'turns'"
                )
            prompts.append({"id": str(obj.get("id", len(prompts))), **record})
    if not prompts:
        raise PromptError(f"{path}: no prompts")
    return prompts


def jsonl_objects(path: Path, lines, limit: int | None):
    """(``file:line``, object) of each non-empty line, up to ``limit`` objects."""
    n_out = 0
    for n, line in enumerate(lines, 1):
        if limit is not None and n_out >= limit:
            return
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(obj, dict):
            raise PromptError(f"{where}: expected a JSON object")
        n_out += 1
        yield where, obj


# ------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------


def acceptance_stats(outputs, block_size: int) -> dict:
    """tau (z-lab's and pooled), histogram and per-position acceptance of SpecOutputs."""
    per_prompt = [o.acceptance_lengths for o in outputs if o.acceptance_lengths]
    all_steps = [a for lst in per_prompt for a in lst]
    accepted = [a for o in outputs for a in o.accepted]
    drafted = [d for o in outputs for d in o.drafted]
    n = len(all_steps)
    hist = [all_steps.count(b) / n if n else 0.0 for b in range(block_size + 1)]
    per_pos, cond = [], []
    for k in range(1, block_size):
        tried = [a for a, d in zip(accepted, drafted, strict=True) if d >= k]
        reached = [a for a in tried if a >= k - 1]
        per_pos.append(sum(a >= k for a in tried) / len(tried) if tried else None)
        cond.append(sum(a >= k for a in reached) / len(reached) if reached else None)
    return {
        "tau": sum(sum(x) / len(x) for x in per_prompt) / len(per_prompt) if per_prompt else None,
        "tau_pooled": sum(all_steps) / n if n else None,
        "num_steps": n,
        "histogram": hist,
        "per_position_acceptance": per_pos,
        "conditional_acceptance": cond,
    }


# ------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------


def evaluate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 256,
    stop_token_ids: Sequence[int] = (),
    block_size: int | None = None,
    sampling=None,
    batch_size: int = 8,
    baseline: bool = True,
    warmup: bool = True,
    seed: int = 0,
    ids: Sequence[str] | None = None,
    progress: bool = False,
    exact_tail: bool = True,
    attention_impl: str | None = "xla",
) -> dict:
    """Speculative decoding of token-id ``prompts``; returns ``{"summary": ..., "prompts": [...]}``.

    ``baseline``: also decode with the plain KV-cache decoder, for tokens/s and (greedy) the
    lossless check. ``warmup``: run one batch per prompt-length bucket first so timings exclude
    compilation. ``attention_impl``: the drafter's attention for decoding (default ``xla``, so a
    drafter straight from Pallas training runs anywhere; None keeps its config's).
    """
    import jax
    from tqdm import tqdm

    from dflash_jax.decoding.generate import generate
    from dflash_jax.decoding.sampling import SamplingConfig
    from dflash_jax.decoding.speculative import SpeculativeDecoder

    sampling = sampling or SamplingConfig()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = [list(p) for p in prompts]
    dec = SpeculativeDecoder(
        target,
        drafter,
        block_size=block_size,
        sampling=sampling,
        exact_tail=exact_tail,
        attention_impl=attention_impl,
    )
    S = dec.block_size
    batches = length_sorted_batches(prompts, batch_size)
    stops = tuple(int(s) for s in stop_token_ids)
    key = jax.random.key(seed)

    def run_spec(idx, b):
        return dec.run_batch(
            [prompts[i] for i in idx],
            max_new_tokens=max_new_tokens,
            stop_token_ids=stops,
            batch_size=batch_size,
            key=jax.random.fold_in(key, b),
        )

    def run_base(idx, b):
        return generate(
            target,
            [prompts[i] for i in idx],
            max_new_tokens=max_new_tokens,
            eos_token_ids=stops,
            sampling=sampling,
            batch_size=batch_size,
            seed=seed + b,
        )

    if warmup:
        seen = set()
        for b, idx in enumerate(batches):
            bucket = bucket_length(max(len(prompts[i]) for i in idx))
            if bucket not in seen:
                seen.add(bucket)
                run_spec(idx, b)
                if baseline:
                    run_base(idx, b)

    def timed(run, desc):
        """Every batch through ``run``; per-prompt results in prompt order, and the seconds."""
        batch_outputs = []
        bar = tqdm(total=len(prompts), desc=desc, disable=not progress)
        t0 = time.perf_counter()
        for b, idx in enumerate(batches):
            batch_outputs.append(run(idx, b))
            bar.update(len(idx))
        seconds = time.perf_counter() - t0
        bar.close()
        return in_prompt_order(batches, batch_outputs), seconds

    outputs, spec_s = timed(run_spec, "speculative")
    base_out, base_s = timed(run_base, "baseline") if baseline else (None, None)

    rows = []
    for i, o in enumerate(outputs):
        row = {
            "id": ids[i] if ids is not None else str(i),
            "prompt_len": o.prompt_len,
            "output_ids": o.output_ids,
            "acceptance_lengths": o.acceptance_lengths,
            "accepted": o.accepted,
            "drafted": o.drafted,
            "num_steps": o.num_steps,
            "tau": sum(o.acceptance_lengths) / o.num_steps if o.num_steps else None,
            "stopped": o.stopped,
        }
        if base_out is not None:
            row["baseline_output_ids"] = base_out[i]
            if sampling.temperature == 0:
                row["matches_baseline"] = base_out[i] == o.output_ids
        rows.append(row)
    summary = summarize(
        rows,
        block_size=S,
        max_new_tokens=max_new_tokens,
        temperature=sampling.temperature,
        batch_size=batch_size,
        seconds=spec_s,
        baseline_seconds=base_s,
    )
    return {"summary": summary, "prompts": rows}


def _outputs_of(rows: Sequence[dict]) -> list:
    from dflash_jax.decoding.speculative.driver import SpecOutput

    return [
        SpecOutput(r["prompt_len"], r["output_ids"], r["acceptance_lengths"], r["accepted"], r["drafted"])
        for r in rows
    ]


def summarize(
    rows: Sequence[dict],
    *,
    block_size: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seconds: float,
    baseline_seconds: float | None = None,
) -> dict:
    """The summary of :func:`evaluate`'s per-prompt ``rows`` decoded in ``seconds`` (and, with
    ``baseline_output_ids`` in the rows, plainly in ``baseline_seconds``)."""
    outputs = _outputs_of(rows)
    n_out = sum(len(o.output_ids) for o in outputs)
    spec_forwards = sum(o.target_forwards for o in outputs)
    summary = {
        "num_prompts": len(rows),
        "block_size": block_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "batch_size": batch_size,
        **acceptance_stats(outputs, block_size),
        "output_tokens": n_out,
        "target_forwards": spec_forwards,
        "baseline_target_forwards": n_out,
        "target_forward_speedup": n_out / spec_forwards if spec_forwards else None,
        "seconds": seconds,
        "tokens_per_s": n_out / seconds if seconds > 0 else None,
    }
    if rows and all("baseline_output_ids" in r for r in rows) and baseline_seconds is not None:
        n_base = sum(len(r["baseline_output_ids"]) for r in rows)
        summary.update(
            baseline_seconds=baseline_seconds,
            baseline_tokens_per_s=n_base / baseline_seconds if baseline_seconds > 0 else None,
            wall_speedup=(n_out / seconds) / (n_base / baseline_seconds)
            if seconds > 0 and baseline_seconds > 0 and n_base
            else None,
        )
        if temperature == 0:
            summary["matches_baseline"] = sum(r["matches_baseline"] for r in rows)
            summary["lossless"] = summary["matches_baseline"] == len(rows)
    return summary


def evaluate_conversations(
    target,
    drafter,
    records: Sequence[dict],
    *,
    tokenizer=None,
    enable_thinking: bool | None = None,
    seed: int = 0,
    **evaluate_kwargs,
) -> dict:
    """Speculative decoding of ``load_prompts`` records (``{"id", "input_ids"}`` or ``{"id",
    "turns"}``), turn by turn (module doc); the report of :func:`evaluate`, one row per turn.

    The rows of ``turns`` records carry ``turn`` (1-based) and the ``messages`` their prompt was
    encoded from: earlier turns with the answers decoded from the speculative output (special
    tokens skipped, as z-lab's benchmark decodes them). ``tokenizer`` encodes and decodes text
    turns; ``evaluate_kwargs`` go to :func:`evaluate` for every turn.
    """
    records = list(records)
    if not records:
        raise PromptError("no prompts to evaluate")
    if any("turns" in r for r in records) and tokenizer is None:
        first = next(r["id"] for r in records if "turns" in r)
        raise PromptError(f"prompt {first!r}: text turns need a tokenizer (target.tokenizer)")
    history: list[list[dict]] = [[] for _ in records]
    turn_rows: dict[tuple[int, int], dict] = {}  # (record index, turn) -> row
    seconds, baseline_seconds = 0.0, 0.0
    turns_of_record = [len(r["turns"]) if "turns" in r else 1 for r in records]
    n_turns = max(turns_of_record, default=0)
    for t in range(n_turns):
        todo = [i for i, n in enumerate(turns_of_record) if t < n]
        prompts = []
        for i in todo:
            r = records[i]
            if "turns" in r:
                history[i].append({"role": "user", "content": r["turns"][t]})
                prompts.append(encode_prompt(tokenizer, history[i], enable_thinking))
            else:
                prompts.append(r["input_ids"])
        rep = evaluate(
            target,
            drafter,
            prompts,
            ids=[records[i]["id"] for i in todo],
            seed=seed + t,  # a stream of its own per turn when sampling
            **evaluate_kwargs,
        )
        summary = rep["summary"]
        seconds += summary["seconds"]
        baseline_seconds += summary.get("baseline_seconds") or 0.0
        for i, row in zip(todo, rep["prompts"], strict=True):
            if "turns" in records[i]:
                row.update(turn=t + 1, messages=[dict(m) for m in history[i]])
                answer = tokenizer.decode(row["output_ids"], skip_special_tokens=True)
                history[i].append({"role": "assistant", "content": answer})
            turn_rows[i, t] = row
    rows = [turn_rows[i, t] for i, n in enumerate(turns_of_record) for t in range(n)]
    out = summarize(
        rows,
        block_size=summary["block_size"],
        max_new_tokens=summary["max_new_tokens"],
        temperature=summary["temperature"],
        batch_size=summary["batch_size"],
        seconds=seconds,
        baseline_seconds=baseline_seconds if "baseline_seconds" in summary else None,
    )
    if n_turns > 1:
        out["num_conversations"] = len(records)
        by_turn = [[r for r in rows if r.get("turn", 1) == t + 1] for t in range(n_turns)]
        out["tau_by_turn"] = [acceptance_stats(_outputs_of(rs), out["block_size"])["tau"] for rs in by_turn]
    return {"summary": out, "prompts": rows}


def format_summary(s: dict) -> str:
    def f(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    lines = [
        f"prompts: {s['num_prompts']}  block size: {s['block_size']}  max new tokens: {s['max_new_tokens']}  "
        f"temperature: {s['temperature']}",
        f"tau (z-lab, per-prompt mean): {f(s['tau'])}   pooled: {f(s['tau_pooled'])}   steps: {s['num_steps']}",
        "acceptance length histogram: "
        + " ".join(f"{b}:{h * 100:.1f}%" for b, h in enumerate(s["histogram"])),
        "per-position acceptance: " + " ".join(f(x, ".2f") for x in s["per_position_acceptance"]),
        f"target forwards: {s['target_forwards']} vs {s['baseline_target_forwards']} plain "
        f"(speedup {f(s['target_forward_speedup'], '.2f')}x)",
        f"speculative: {s['output_tokens']} tokens in {s['seconds']:.2f}s = {f(s['tokens_per_s'], '.1f')} tok/s",
    ]
    if "tau_by_turn" in s:
        by_turn = " ".join(f(x) for x in s["tau_by_turn"])
        lines.insert(2, f"conversations: {s['num_conversations']}   tau by turn: {by_turn}")
    if "baseline_seconds" in s:
        lines.append(
            f"baseline: {f(s['baseline_tokens_per_s'], '.1f')} tok/s; wall speedup {f(s['wall_speedup'], '.2f')}x"
        )
    if "lossless" in s:
        lines.append(
            f"lossless check: {s['matches_baseline']}/{s['num_prompts']} outputs equal plain greedy decoding"
            + ("" if s["lossless"] else "  <-- MISMATCH")
        )
    return "\n".join(lines)


__all__ = [
    "PromptError",
    "acceptance_stats",
    "evaluate",
    "evaluate_conversations",
    "format_summary",
    "load_prompts",
    "summarize",
    "turns_of",
]
