"""Write the WORKDIR of a PyTorch reference trainer (``ref_train.py``, z-lab's DFlashDraftModel)
from one of our runs' data, so that the PyTorch reference and our trainer train on the same token
sequences and are measured on the same held-out prompts (BENCHMARKS.md, "Side by side with the PyTorch references").

  python scripts/reference_workdir.py --out WORKDIR --train-jsonl REGEN/train.jsonl \
      [--config demo] [OVERRIDES ...]

REGEN/train.jsonl: the regenerated answers of the run (``$DFLASH_JAX_CACHE/regenerated/<key>/``).
Writes ``prompts.json`` (``eval``: the run's held-out prompt ids, the ones its evaluator decodes;
``train``: the training prompts) and ``regen.json`` (prompt ids + reply ids, tokenized as our data
pipeline does, truncated at ``data.max_length``), which ref_train.py then reads instead of drawing
and regenerating its own; and ``heldout_prompts.jsonl`` (``input_ids`` lines) for
``python -m dflash_jax.eval eval.prompts=FILE`` on the reference's drafter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="ref_train.py's WORKDIR (created)")
    p.add_argument("--train-jsonl", required=True, type=Path, help="the run's regenerated train.jsonl")
    p.add_argument("--config", default="demo")
    p.add_argument("--overwrite", action="store_true", help="replace the files of an existing WORKDIR")
    p.add_argument("overrides", nargs="*", help="the run's config overrides (key=value)")
    args = p.parse_args(argv)
    existing = [n for n in ("prompts.json", "regen.json") if (args.out / n).exists()]
    if existing and not args.overwrite:
        sys.exit(f"{args.out} already holds {', '.join(existing)}; pass --overwrite to replace them")

    from transformers import AutoTokenizer

    from dflash_jax.data import chat
    from dflash_jax.data.sources import read_chat_jsonl
    from dflash_jax.decoding.prompts import encode_prompt
    from dflash_jax.training.assembly import resolve_tokenizer_dir
    from dflash_jax.training.evaluation import heldout_prompt_ids
    from dflash_jax.training.run_config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    tok_dir = resolve_tokenizer_dir(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    eot = cfg.data.eot_token or chat.end_of_turn_token(tokenizer, chat_template=cfg.data.chat_template)

    held = heldout_prompt_ids(cfg, tokenizer)
    rows, train_prompts = [], []
    for n, rec in enumerate(read_chat_jsonl(args.train_jsonl, on_bad_record="fail"), 1):
        messages = rec["messages"]
        prompt = encode_prompt(tokenizer, messages[:-1], cfg.data.enable_thinking)
        ids, _ = chat.tokenize_conversation(
            tokenizer,
            messages,
            enable_thinking=cfg.data.enable_thinking,
            chat_template=cfg.data.chat_template,
            eot_token=eot,
        )
        ids = [int(t) for t in ids[: cfg.data.max_length]]
        if ids[: len(prompt)] != prompt:
            sys.exit(f"{args.train_jsonl}:{n}: the conversation's tokens do not start with its prompt's")
        train_prompts.append(prompt)
        rows.append({"prompt": prompt, "response": ids[len(prompt) :]})

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prompts.json").write_text(json.dumps({"eval": held, "train": train_prompts}))
    (args.out / "regen.json").write_text(json.dumps(rows))
    with open(args.out / "heldout_prompts.jsonl", "w") as f:
        for ids in held:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    print(
        f"{args.out}: {len(held)} held-out prompts, {len(rows)} training sequences "
        f"({sum(len(r['prompt']) + len(r['response']) for r in rows)} tokens)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
