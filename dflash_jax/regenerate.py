"""Regenerate chat responses with the target model itself (``python -m dflash_jax.regenerate``).

DFlash drafters learn to predict the *target's* continuations, so training data is remade by
answering each prompt with the target (greedy or sampled), KV-cached and batched in JAX. The
output is chat JSONL (OpenAI ``messages``) that the data pipeline reads.

  python -m dflash_jax.regenerate [--config NAME|YAML|RUN_DIR] [key=value ...] --out FILE [--overwrite | --resume]

The config is a run's (default ``demo``): the target (``target.path``, ``target.tokenizer``,
``target.dtype``), the prompts (the first ``regen.num_prompts`` records of ``data.sources``, a chat
JSON/JSONL path or ``sharegpt``, each of at most ``regen.max_prompt_tokens`` tokens), the thinking
switch (``data.enable_thinking``) and the answers (``regen.max_new_tokens``, ``regen.batch_size``,
``regen.temperature``). The command's own keys, ``regen.top_p`` and ``regen.seed``, sit in the
same section (:class:`RegenerateOptions`). For example::

  python -m dflash_jax.regenerate target.path=HF_DIR data.sources=sharegpt regen.num_prompts=800 --out regen.jsonl

``regen.backend=server regen.base_urls=http://HOST:PORT/v1`` sends the prompts to an OpenAI-compatible
server of the target instead (vLLM, SGLang, ``transformers serve``; its model is checked first and
the target's weights are not loaded here): ``regen.concurrency``, ``regen.timeout_s``,
``regen.retries``, ``regen.turns=all`` (every assistant turn, given the regenerated history),
``regen.keep_reasoning``. Each record is appended to ``--out`` as it is answered; after a crash or a
kill, ``--resume`` keeps the records there (a torn last line is redone) and answers the rest. When
all are answered the file is rewritten in the prompts' order.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from dflash_jax.cli import UserError, check_output_free, cli
from dflash_jax.config_io import check_fields

log = logging.getLogger(__name__)

PROG = "python -m dflash_jax.regenerate"


@dataclass(frozen=True)
class RegenerateOptions:
    """The command's keys of the ``regen`` section (the run's own are ``num_prompts``,
    ``max_new_tokens``, ``max_prompt_tokens``, ``batch_size``, ``temperature``, ...:
    ``training.run_config.RegenSection``)."""

    top_p: float = 1.0  # with regen.temperature > 0
    seed: int = 0  # of the sampling

    def __post_init__(self):
        check_fields(self)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"regen.top_p must be in (0, 1], got {self.top_p}")


# The flags of the command before it took a config, each with its new spelling.
RENAMED_FLAGS = {
    "--target": "target.path=DIR",
    "--data": "data.sources=PATH (or sharegpt)",
    "--num-prompts": "regen.num_prompts=N",
    "--max-new-tokens": "regen.max_new_tokens=N",
    "--max-prompt-tokens": "regen.max_prompt_tokens=N",
    "--batch-size": "regen.batch_size=N",
    "--temperature": "regen.temperature=T",
    "--top-p": "regen.top_p=P",
    "--enable-thinking": "data.enable_thinking=true|false",
    "--dtype": "target.dtype=DTYPE (default: the run's)",
    "--seed": "regen.seed=N",
}


def parse_args(argv: list[str] | None = None):
    """-> (argparse namespace, :class:`~dflash_jax.command_config.CommandConfig`)."""
    from dflash_jax.command_config import parse_command

    def add_flags(p):
        p.add_argument(
            "--out", required=True, help="output chat JSONL (an existing file is kept unless --overwrite)"
        )
        p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
        p.add_argument(
            "--resume",
            action="store_true",
            help="keep the records --out already holds (by id) and answer only the others",
        )

    return parse_command(
        argv,
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        renamed=RENAMED_FLAGS,
        section="regen",
        options_cls=RegenerateOptions,
        add_flags=add_flags,
        example="regen.num_prompts=800",
    )


@cli
def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.resume and args.overwrite:
        raise UserError("--resume keeps what --out holds and --overwrite replaces it: pass one of them")
    # Before the target loads: a regenerated file can cost hours of accelerator time.
    if not args.resume:
        check_output_free(args.out, overwrite=args.overwrite)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    cfg, opts = config.run, config.options
    r = cfg.regen

    from pathlib import Path

    from transformers import AutoTokenizer

    import dflash_jax
    from dflash_jax.decoding.regeneration import InProcess, Server, read_records, regenerate_file
    from dflash_jax.decoding.sampling import SamplingConfig
    from dflash_jax.training.assembly import target_and_tokenizer_dirs

    target_dir, tok_dir = target_and_tokenizer_dirs(cfg, config.run_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if r.backend == "server":
        # Checked before a prompt is read or sent; the target's weights are never loaded here.
        backend = Server.connect(
            r, target_dir, tokenizer, cfg.data.enable_thinking, top_p=opts.top_p, seed=opts.seed
        )
    else:
        backend = InProcess(
            dflash_jax.load_target(
                target_dir, dtype=cfg.target.dtype, attention_impl=cfg.target.attention_impl
            ),
            max_new_tokens=r.max_new_tokens,
            batch_size=r.batch_size,
            sampling=SamplingConfig(r.temperature, opts.top_p),
            seed=opts.seed,
        )
    records = read_records(cfg.data.sources, r.num_prompts, cfg.data.on_bad_record)
    out = Path(args.out).expanduser()
    existed = out.is_file()
    report = regenerate_file(
        out,
        records,
        tokenizer,
        backend,
        resume=args.resume,
        max_prompt_tokens=r.max_prompt_tokens,
        enable_thinking=cfg.data.enable_thinking,
        keep_reasoning=r.keep_reasoning,
    )
    if not report.written:
        if out.is_file() and not existed:
            out.unlink()  # made empty by this run
        raise UserError(f"nothing to write to {args.out}: {report.summary()}")
    print(report.summary())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
