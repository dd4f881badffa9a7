"""Evaluate a DFlash drafter by speculative decoding against its target (``python -m dflash_jax.eval``).

  python -m dflash_jax.eval --target HF_DIR --drafter PATH --prompts FILE \
      [--max-new-tokens N] [--block-size S] [--batch-size B] [--json OUT]

``--drafter``: one of our checkpoints (run dir, ``checkpoints/`` dir or ``<step>`` dir) or an HF
drafter directory (z-lab or speculators layout). ``--prompts``: JSONL of ``messages``, ``prompt`` or
``input_ids`` lines (formats in ``dflash_jax.decoding.evaluation``); text prompts need a tokenizer
(``--tokenizer``, default the target dir).

Greedy by default: lossless, so the output equals the target's own greedy decoding, which is
checked against plain KV-cache decoding unless ``--no-baseline`` (exit 1 on a mismatch). The
metrics (tau, histogram, per-position acceptance, forward and wall speedups) are described in
``dflash_jax.decoding.evaluation``; timings exclude compilation unless ``--no-warmup``.
``--temperature > 0`` samples with the standard speculative-sampling acceptance rule (lossless in
distribution, not token-for-token; no baseline comparison is made then).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dflash_jax.cli import check_output_free, cli
from dflash_jax.decoding.evaluation import PromptError, evaluate, format_summary, load_prompts
from dflash_jax.decoding.prompts import stop_token_ids
from dflash_jax.dtypes import COMPUTE_DTYPE_NAMES

log = logging.getLogger(__name__)


def _stop_ids(args, target_config, tokenizer) -> tuple[int, ...]:
    """--ignore-eos: none; --stop-token-ids: those, as given; else the target's and tokenizer's EOS ids."""
    if args.ignore_eos:
        return ()
    if args.stop_token_ids is not None:
        return tuple(int(t) for t in args.stop_token_ids.split(",") if t.strip())
    return stop_token_ids(target_config, tokenizer)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target HF model directory")
    p.add_argument("--drafter", required=True, help="drafter: checkpoint dir or HF dir (z-lab/speculators)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step of --drafter (default: latest)")
    p.add_argument("--prompts", required=True, help="JSONL of messages / prompt / input_ids")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for text prompts (default: --target)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's block_size")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="> 0: speculative sampling (lossless in distribution)"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token-ids", default=None, help="comma-separated; default: the target's EOS ids")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument(
        "--enable-thinking", choices=("on", "off"), default=None, help="chat template switch (Qwen3)"
    )
    p.add_argument(
        "--dtype", default="float32", choices=COMPUTE_DTYPE_NAMES, help="target and drafter compute dtype"
    )
    p.add_argument("--attention-impl", default="xla", choices=("xla", "reference", "pallas"))
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no tokens/s comparison)")
    p.add_argument("--no-warmup", action="store_true", help="timings then include compilation")
    p.add_argument(
        "--fast-tail",
        action="store_true",
        help="near the length limit draft full blocks (fewer compiles; last steps' acceptance may differ from z-lab)",
    )
    p.add_argument("--json", default=None, help="write the full report (summary + per-prompt) here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    args = p.parse_args(argv)
    if args.json:
        check_output_free(args.json, overwrite=args.overwrite, flag="--json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import dflash_jax
    from dflash_jax.decoding.sampling import SamplingConfig
    from dflash_jax.loading import load_drafter

    try:
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        target = dflash_jax.load_target(args.target, dtype=args.dtype)
        # The drafter is checked against the target (sizes, layer ids) before anything runs.
        drafter = load_drafter(
            args.drafter, target, step=args.step, attention_impl=args.attention_impl, compute_dtype=args.dtype
        )
        tok_holder: list = []

        def tokenizer():
            from transformers import AutoTokenizer

            src = args.tokenizer or args.target
            try:
                tok_holder.append(AutoTokenizer.from_pretrained(src))
            except Exception as e:  # noqa: BLE001 - transformers raises many types
                raise PromptError(f"cannot load a tokenizer from {src}: {e}") from e
            return tok_holder[-1]

        thinking = None if args.enable_thinking is None else args.enable_thinking == "on"
        records = load_prompts(args.prompts, tokenizer, enable_thinking=thinking, limit=args.limit)
        tok = tok_holder[-1] if tok_holder else None
        stops = _stop_ids(args, target.config, tok)
        if args.block_size is not None and args.block_size < 2:
            raise ValueError(f"--block-size must be >= 2, got {args.block_size}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    log.info("evaluating %d prompts, stop tokens %s", len(records), list(stops))
    report = evaluate(
        target,
        drafter,
        [r["input_ids"] for r in records],
        ids=[r["id"] for r in records],
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=stops,
        block_size=args.block_size,
        sampling=sampling,
        batch_size=args.batch_size,
        baseline=not args.no_baseline,
        warmup=not args.no_warmup,
        seed=args.seed,
        progress=True,
        exact_tail=not args.fast_tail,
        attention_impl=args.attention_impl,
    )
    report["summary"].update(target=str(args.target), drafter=str(args.drafter), stop_token_ids=list(stops))
    if tok is not None:
        for row in report["prompts"]:
            row["output_text"] = tok.decode(row["output_ids"], skip_special_tokens=True)
    print(format_summary(report["summary"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"report: {args.json}")
    return 1 if report["summary"].get("lossless") is False else 0


if __name__ == "__main__":
    sys.exit(main())
