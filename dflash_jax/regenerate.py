"""Regenerate chat responses with the target model itself (``python -m dflash_jax.regenerate``).

DFlash drafters learn to predict the *target's* continuations, so training data is remade by
answering each prompt with the target (greedy or sampled), KV-cached and batched in JAX. The
output is chat JSONL (OpenAI ``messages``) that the data pipeline reads.

  python -m dflash_jax.regenerate --target DIR --data sharegpt --out regen.jsonl --num-prompts 800
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from dflash_jax.cli import UserError, check_output_free, cli
from dflash_jax.data import sources
from dflash_jax.generate import SamplingConfig, generate

log = logging.getLogger(__name__)


@dataclass
class RegenReport:
    prompts_seen: int = 0
    written: int = 0
    skipped_long: int = 0
    skipped_no_user: int = 0
    stopped_at_eos: int = 0
    empty: int = 0

    def summary(self) -> str:
        return (
            f"regenerated {self.written} responses from {self.prompts_seen} prompts "
            f"({self.stopped_at_eos} ended with EOS; skipped: {self.skipped_long} prompts over the length "
            f"limit, {self.skipped_no_user} without a user turn, {self.empty} empty answers)"
        )


def encode_prompt(tokenizer, messages, enable_thinking=None) -> list[int]:
    """Chat messages -> prompt token ids, ending with the generation prompt of the chat template."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def eos_ids(tokenizer, target_config) -> tuple[int, ...]:
    ids = set(target_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


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
    prompts, kept = [], []
    for rec in records:
        report.prompts_seen += 1
        msgs = sources.prompt_messages(rec["messages"])
        if not any(m["role"] == "user" for m in msgs):
            report.skipped_no_user += 1
            continue
        ids = encode_prompt(tokenizer, msgs, enable_thinking)
        if len(ids) > max_prompt_tokens:
            report.skipped_long += 1
            continue
        prompts.append(ids)
        kept.append((rec, msgs))
    eos = eos_ids(tokenizer, target.config)
    bar = tqdm(total=len(prompts), desc="regenerate", unit="prompt", disable=not show_progress)
    outs = generate(
        target,
        prompts,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos,
        sampling=sampling,
        batch_size=batch_size,
        seed=seed,
        progress=bar.update,
    )
    bar.close()
    result = []
    for (rec, msgs), toks in zip(kept, outs, strict=True):
        if toks and toks[-1] in eos:
            report.stopped_at_eos += 1
            toks = toks[:-1]
        text = tokenizer.decode(toks, skip_special_tokens=True)
        if not text.strip():
            report.empty += 1
            continue
        result.append({"id": f"{rec['id']}", "messages": [*msgs, {"role": "assistant", "content": text}]})
    report.written = len(result)
    return result, report


def read_records(source: str, limit: int | None, on_bad_record: str = "skip") -> list[dict]:
    from dflash_jax.data.pipeline import DataConfig, load_index

    cfg = DataConfig(sources=(source,), max_records=limit, on_bad_record=on_bad_record)
    index, _ = load_index(cfg)
    src = sources.RecordSource(index)
    try:
        return [src[i] for i in range(len(src))]
    finally:
        src.close()


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.regenerate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF model directory of the target (or 'smollm2')")
    p.add_argument("--data", required=True, help="chat JSON/JSONL path, or 'sharegpt'")
    p.add_argument(
        "--out", required=True, help="output chat JSONL (an existing file is kept unless --overwrite)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--enable-thinking", choices=["true", "false"], default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # Before the target loads: a regenerated file can cost hours of accelerator time.
    check_output_free(args.out, overwrite=args.overwrite)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)

    from transformers import AutoTokenizer

    import dflash_jax
    from convert.smollm2 import smollm2_dir

    target_dir = smollm2_dir() if args.target == "smollm2" else args.target
    target = dflash_jax.load_target(target_dir, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    records = read_records(args.data, args.num_prompts)
    thinking = None if args.enable_thinking is None else args.enable_thinking == "true"
    out, report = regenerate_records(
        target,
        tokenizer,
        records,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        sampling=SamplingConfig(args.temperature, args.top_p),
        enable_thinking=thinking,
        seed=args.seed,
    )
    if not out:
        raise UserError(f"nothing to write to {args.out} ({args.out} left as it was): {report.summary()}")
    sources.write_chat_jsonl(args.out, out)
    print(report.summary())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
