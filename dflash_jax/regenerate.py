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

from dflash_jax.cli import UserError, check_output_free, cli
from dflash_jax.data import sources
from dflash_jax.decoding.regeneration import read_records, regenerate_records
from dflash_jax.decoding.sampling import SamplingConfig

log = logging.getLogger(__name__)


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
