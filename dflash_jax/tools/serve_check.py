"""The train-to-serve consistency gate: a run's exports decoded by the real clients must accept
what our evaluator accepts (``python -m dflash_jax.serve_check``, ``dflash-serve-check``).

  python -m dflash_jax.serve_check --config RUN_DIR [key=value ...] [--out EXPORT_DIR] [--json OUT]

1. The run's drafter (``eval.step``, default the latest checkpoint) is exported in both formats,
   float32 (``convert.drafter_to_hf``'s writers), under ``--out`` (default ``RUN_DIR/serve_check``, replaced
   on every run): z-lab's (``zlab/``; refused, and that leg left out, for a drafter with a draft
   vocabulary) and speculators' (``speculators/``).
2. Our evaluator (``dflash_jax.decoding.evaluation.evaluate``, exact tail) decodes the prompts
   greedily with the checkpoint, target and drafter in float32.
3. z-lab's client: ``dflash.model.DFlashDraftModel`` loads the z-lab export and
   ``dflash.model.dflash_generate`` decodes the same prompts over the transformers target.
4. speculators' client: ``speculators.SpeculatorModel`` loads the speculators export (its verifier's
   embeddings and head from the target directory). speculators ships no decoding loop that runs on
   CPU (it serves through vLLM), so its drafts are taken from the model's own anchored-block
   forward over the target's greedy answer, one block at every position a step could start; the
   steps are then walked as ``dflash_generate`` walks them (block ``min(B, room left)``, greedy
   check against the transformers target's argmax, cut at a stop token). Greedy decoding is
   lossless, so this is the decoding a server would do with that drafter, step for step. A
   drafter with sliding-window layers leaves this leg out: speculators 0.9.0's model class counts
   a sliding window back from the block's anchor for every slot, z-lab's and ours from each
   slot's own position, so their drafts differ by design there.
5. Per prompt, each client's tau (mean accepted length per step, the bonus token counted) must be
   within ``eval.tolerance`` (default 0.05 tokens per step) of ours; otherwise the gate fails (exit
   1) naming the prompt, the client and both taus. In float32 the clients and ours agree step for
   step; the tolerance leaves room for a near-tie argmax that rounds differently in torch and XLA.

The prompts are ``eval.prompts`` (a prompts JSONL: ``input_ids``, ``prompt``, ``question``,
``messages``; a ``turns`` record contributes its first turn), else the run's held-out prompts of
``eval.split`` (default ``test``); the first ``eval.limit`` (default 4) of them, each answered with
``eval.max_new_tokens`` tokens. At the end the gate prints the ``vllm serve`` and SGLang commands
for the exports (``serve_commands``), with ``num_speculative_tokens = B - 1``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dflash_jax.cli import check_output_free, cli
from dflash_jax.config_io import check_fields

log = logging.getLogger(__name__)

PROG = "python -m dflash_jax.serve_check"
CLIENTS = ("zlab", "speculators")
EXPORT_SUBDIR = "serve_check"  # the exports' default place in the run directory


@dataclass(frozen=True)
class ServeCheckOptions:
    """The gate's keys of the ``eval`` section."""

    step: int | None = None  # checkpoint step (default: the latest)
    prompts: str | None = None  # a prompts JSONL; default: the run's held-out prompts of eval.split
    split: Literal["test", "validation"] = "test"
    limit: int = 4  # the first N prompts
    block_size: int | None = None  # default: the drafter's
    # the largest per-prompt tau difference (tokens per verify step) a client may show against ours
    tolerance: float = 0.05
    # the verifier recorded in the speculators export and named in the serve commands (default:
    # the run's target)
    verifier: str | None = None

    def __post_init__(self):
        check_fields(self)
        if self.limit < 1:
            raise ValueError(f"eval.limit must be >= 1, got {self.limit}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"eval.block_size must be >= 2, got {self.block_size}")
        if not self.tolerance >= 0:
            raise ValueError(f"eval.tolerance must be >= 0, got {self.tolerance}")


class NotComparable(ValueError):
    """A client whose decoding of this drafter cannot be compared with ours (the reason)."""


# ------------------------------------------------------------------------------------------
# Exports
# ------------------------------------------------------------------------------------------


def export_both(checkpoint, out: Path, *, verifier, step=None) -> dict[str, Path | str]:
    """Export ``checkpoint`` to ``out/zlab`` and ``out/speculators`` in float32, replacing what is
    there, with ``convert.drafter_to_hf``'s writers -> {client: dir}, or for z-lab's format and a
    drafter with a draft vocabulary (which it cannot hold), the reason (a string)."""
    import shutil

    from convert.speculators import write_speculators_drafter
    from convert.zlab_drafter import write_zlab_drafter
    from dflash_jax.checkpoint import nonfinite_params, read_checkpoint

    config, params, _ = read_checkpoint(checkpoint, step)
    bad = nonfinite_params(params)
    if bad:
        raise FloatingPointError(f"checkpoint {checkpoint}: parameters not finite ({', '.join(bad[:5])})")
    exports: dict[str, Path | str] = {}
    for fmt in CLIENTS:
        path = Path(out) / fmt
        shutil.rmtree(path, ignore_errors=True)
        if fmt == "zlab" and config.draft_vocab_size is not None:
            exports[fmt] = (
                f"z-lab's format holds no draft vocabulary (draft_vocab_size={config.draft_vocab_size})"
            )
        elif fmt == "zlab":
            exports[fmt] = write_zlab_drafter(path, config, params, dtype="float32")
        else:
            exports[fmt] = write_speculators_drafter(path, config, params, dtype="float32", verifier=verifier)
    return exports


# ------------------------------------------------------------------------------------------
# The clients
# ------------------------------------------------------------------------------------------


def load_hf_target(target_dir):
    """The transformers target both clients verify with (float32, eval mode)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def zlab_acceptance(export_dir, hf_target, prompts, *, max_new_tokens, stop_token_ids, block_size=None):
    """z-lab's ``dflash_generate`` on each prompt -> [(output ids, acceptance lengths)]."""
    import time

    import torch
    from dflash import model as dm

    model = dm.DFlashDraftModel.from_pretrained(export_dir, dtype=torch.float32).eval()
    # return_stats times the steps with torch.cuda.synchronize: the plain clock on a CPU.
    cuda_time, dm._cuda_time = dm._cuda_time, time.perf_counter
    try:
        out = []
        for p in prompts:
            r = dm.dflash_generate(
                model,
                hf_target,
                torch.tensor(p)[None],
                max_new_tokens,
                list(stop_token_ids) or None,
                block_size=block_size,
                return_stats=True,
            )
            out.append((r.output_ids[0, len(p) :].tolist(), [int(a) for a in r.acceptance_lengths]))
        return out
    finally:
        dm._cuda_time = cuda_time


def _layer_outputs(hf_target, ids, layer_ids):
    """(raw outputs of decoder layers ``layer_ids`` concatenated [1, T, K*H], argmax [T]) of the
    transformers target on ``ids``: read by forward hooks, since transformers' last hidden state
    is normed and the drafter takes a last layer's raw output (invariant 1)."""
    import torch

    layers = hf_target.model.layers
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in layer_ids
    ]
    try:
        with torch.no_grad():
            logits = hf_target(torch.tensor(ids)[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i] for i in layer_ids], dim=-1), logits.argmax(-1)


def speculators_acceptance(
    export_dir, hf_target, prompts, answers, *, max_new_tokens, stop_token_ids, block_size=None
):
    """speculators' drafter on each prompt and its greedy answer (module doc, step 4) ->
    [acceptance lengths]. ``answers``: the target's greedy output of each prompt."""
    import torch
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(export_dir)
    if model.uses_sliding_window_attn:
        raise NotComparable(
            "speculators' model class counts a sliding window from the block's anchor, z-lab's and "
            "ours from each slot (module doc)"
        )
    model.load_verifier_weights()  # embeddings (and a full-vocabulary head) from the verifier
    model.eval()
    S = model.block_size if block_size is None else block_size
    if S > model.block_size:
        raise ValueError(f"eval.block_size={S} is larger than the drafter's block size {model.block_size}")
    stops = set(int(s) for s in stop_token_ids)
    d2t = getattr(model, "d2t", None)
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        P, seq = len(prompt), list(prompt) + list(answer)
        max_length = P + max_new_tokens
        starts = list(range(P, min(len(seq), max_length - 1)))
        if not starts:
            out.append([])
            continue
        # speculators' aux ids count hidden states with the embeddings as 0, as vLLM collects them:
        # aux id a is the output of decoder layer a - 1
        feats, posterior = _layer_outputs(hf_target, seq, [a - 1 for a in model.target_layer_ids])
        B = model.block_size
        # select_anchors never anchors in the last B positions and picks every marked one when
        # max_anchors equals their count: pad B positions (never seen: they follow every anchor).
        T = len(seq) + B
        ids = torch.tensor(seq + [model.mask_token_id] * B)[None]
        feats = torch.cat([feats, feats.new_zeros(1, B, feats.shape[-1])], dim=1)
        loss_mask = torch.zeros(1, T, dtype=torch.long)
        loss_mask[0, starts] = 1
        with torch.no_grad():
            _, logits, _, _, _ = model._backbone_forward(
                feats,
                ids,
                loss_mask,
                feats.new_zeros(1, T, hf_target.config.hidden_size),  # training targets: unused
                torch.ones(1, T, dtype=torch.long),
                max_anchors=len(starts),
            )
        drafts = logits[0].argmax(-1).view(len(starts), B)
        if d2t is not None and getattr(model, "use_draft_vocab", False):
            drafts = drafts + d2t[drafts]
        drafts = drafts.tolist()
        lengths, start = [], P
        while start + 1 < max_length and start < len(seq) and seq[start] not in stops:
            verify = min(S, max_length - start)
            block = drafts[start - P][1:verify]
            accepted = 0
            while (
                accepted < len(block)
                and start + accepted < len(seq)
                and block[accepted] == int(posterior[start + accepted])
            ):
                accepted += 1
            produced = min(accepted + 1, max_length - start - 1)
            emitted = [int(posterior[start + j]) for j in range(produced)]
            cut = next((j for j, t in enumerate(emitted) if t in stops), None)
            if cut is not None:
                produced = cut + 1
            lengths.append(produced)
            start += produced
            if cut is not None:
                break
        out.append(lengths)
    return out


# ------------------------------------------------------------------------------------------
# The gate
# ------------------------------------------------------------------------------------------


def _tau(lengths) -> float | None:
    return sum(lengths) / len(lengths) if lengths else None


def compare_taus(ours: dict[str, list[int]], theirs: dict[str, list[int]], client: str, tolerance: float):
    """Per-prompt rows {id, ours, client} and the failures (strings naming the prompt and both taus)."""
    rows, failures = [], []
    for pid, lengths in ours.items():
        a, b = _tau(lengths), _tau(theirs[pid])
        rows.append({"id": pid, "ours": a, client: b})
        if (a is None) != (b is None) or (a is not None and abs(a - b) > tolerance):
            failures.append(
                f"prompt {pid!r}: {client} tau {_fmt(b)} vs ours {_fmt(a)} "
                f"(tolerance {tolerance}; steps {theirs[pid]} vs {lengths})"
            )
    return rows, failures


def _fmt(x):
    return "n/a" if x is None else f"{x:.3f}"


def check_exports(
    target,
    drafter,
    target_dir,
    exports: dict[str, Path | str],
    prompts: list[list[int]],
    *,
    ids=None,
    max_new_tokens: int,
    stop_token_ids=(),
    block_size: int | None = None,
    tolerance: float = 0.05,
    hf_target=None,
) -> dict:
    """Decode ``prompts`` with our evaluator and each client's export (module doc) ->
    ``{"block_size", "tolerance", "prompts": [...], "clients": {name: "ok" | reason}, "failures"}``."""
    from dflash_jax.decoding.evaluation import evaluate

    ids = [str(i) for i in range(len(prompts))] if ids is None else list(ids)
    rep = evaluate(
        target,
        drafter,
        prompts,
        ids=ids,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        block_size=block_size,
        batch_size=max(1, len(prompts)),
        baseline=False,
        warmup=False,
        exact_tail=True,
    )
    ours = {r["id"]: r["acceptance_lengths"] for r in rep["prompts"]}
    answers = [r["output_ids"] for r in rep["prompts"]]
    hf_target = load_hf_target(target_dir) if hf_target is None else hf_target
    kw = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, block_size=block_size)
    theirs, clients = {}, {}
    if isinstance(exports.get("zlab"), Path):
        z = zlab_acceptance(exports["zlab"], hf_target, prompts, **kw)
        theirs["zlab"] = dict(zip(ids, (acc for _, acc in z), strict=True))
        clients["zlab"] = "ok"
    else:
        clients["zlab"] = f"skipped: {exports.get('zlab')}"
    try:
        spec = speculators_acceptance(exports["speculators"], hf_target, prompts, answers, **kw)
        theirs["speculators"] = dict(zip(ids, spec, strict=True))
        clients["speculators"] = "ok"
    except NotComparable as e:
        clients["speculators"] = f"skipped: {e}"

    by_id = {pid: {"id": pid, "ours": _tau(ours[pid])} for pid in ids}
    failures = []
    for client, acc in theirs.items():
        rows, bad = compare_taus(ours, acc, client, tolerance)
        for r in rows:
            by_id[r["id"]][client] = r[client]
        failures += bad
    return {
        "block_size": rep["summary"]["block_size"],
        "tolerance": tolerance,
        "tau": {"ours": rep["summary"]["tau"], **{c: _mean_tau(a) for c, a in theirs.items()}},
        "prompts": list(by_id.values()),
        "clients": clients,
        "failures": failures,
    }


def _mean_tau(acc: dict[str, list[int]]):
    taus = [t for t in map(_tau, acc.values()) if t is not None]
    return sum(taus) / len(taus) if taus else None


def serve_commands(exports: dict[str, Path | str], verifier: str, block_size: int) -> dict[str, str]:
    """The launch commands of the exports for vLLM and SGLang (``num_speculative_tokens = B - 1``:
    the block's first slot is the last verified token).

    vLLM: ``--speculative-config`` with ``method: dflash`` as vLLM's speculative-decoding docs and
    z-lab's model cards give it (vLLM 0.28); a speculators directory is also served by its own path
    alone (``vllm serve DIR``: speculators' "Serve in vLLM" guide, 0.9). SGLang:
    ``--speculative-algorithm DFLASH``, ``--speculative-draft-model-path`` and
    ``--speculative-num-draft-tokens`` (the verify block, B), as in SGLang's DFlash docs
    (sgl-project/sglang#23553)."""
    out = {}
    for fmt in CLIENTS:
        path = exports.get(fmt)
        if not isinstance(path, Path):
            continue
        spec = json.dumps(
            {"method": "dflash", "model": str(path.resolve()), "num_speculative_tokens": block_size - 1}
        )
        out[f"vllm ({fmt})"] = f"vllm serve {verifier} --speculative-config '{spec}'"
        if fmt == "speculators":
            out["vllm (speculators, config only)"] = f"vllm serve {path.resolve()}"
        if fmt == "zlab":
            out["sglang (zlab)"] = (
                f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {path.resolve()} --speculative-num-draft-tokens {block_size}"
            )
    return out


# ------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    from dflash_jax.command_config import parse_command

    def add_flags(p):
        p.add_argument(
            "--out", default=None, help=f"the exports' directory (default: RUN_DIR/{EXPORT_SUBDIR})"
        )
        p.add_argument("--json", default=None, help="write the gate's report here")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --json file or --out")

    return parse_command(
        argv,
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        renamed={},
        section="eval",
        options_cls=ServeCheckOptions,
        add_flags=add_flags,
        example="eval.limit=8",
    )


def _prompts(cfg, opts: ServeCheckOptions, tok_dir):
    """(ids, token-id prompts) of the gate."""
    from transformers import AutoTokenizer

    from dflash_jax.decoding.evaluation import PromptError, load_prompts
    from dflash_jax.decoding.prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(tok_dir)
    if opts.prompts is not None:
        records = load_prompts(opts.prompts, tok, enable_thinking=cfg.data.enable_thinking, limit=opts.limit)
        ids = [r["id"] for r in records]
        prompts = [
            r["input_ids"]
            if "input_ids" in r
            else encode_prompt(tok, [{"role": "user", "content": r["turns"][0]}], cfg.data.enable_thinking)
            for r in records
        ]
        return ids, prompts, tok
    from dflash_jax.training.evaluation import heldout_prompt_ids

    held = heldout_prompt_ids(cfg, tok, opts.split)[: opts.limit]
    if not held:
        raise PromptError(
            f"the run has no {opts.split} prompts: set eval.prompts=FILE, or eval.num_prompts / "
            "eval.validation_prompts and data.heldout_* / data.validation_*"
        )
    return [f"{opts.split}-{i}" for i in range(len(held))], held, tok


@cli
def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.json:
        check_output_free(args.json, overwrite=args.overwrite, flag="--json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg, opts = config.run, config.options

    import dflash_jax
    from dflash_jax.decoding.prompts import stop_token_ids
    from dflash_jax.loading import load_drafter
    from dflash_jax.training.assembly import target_and_tokenizer_dirs

    run_dir = config.run_dir
    target_dir, tok_dir = target_and_tokenizer_dirs(cfg, run_dir)
    target = dflash_jax.load_target(target_dir, dtype="float32")
    drafter = load_drafter(
        run_dir, target, step=opts.step, attention_impl="xla", compute_dtype="float32", matmul_dtype="float32"
    )
    ids, prompts, tok = _prompts(cfg, opts, tok_dir)
    # The verifier recorded and served: a target named by its hub name keeps it, a local one its path.
    named = cfg.target.path not in ("tiny", "smollm2") and not Path(cfg.target.path).expanduser().is_dir()
    verifier = opts.verifier or (cfg.target.path if named else str(Path(target_dir).resolve()))

    out = Path(args.out) if args.out else Path(run_dir) / EXPORT_SUBDIR
    if args.out and out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"--out {out} exists and is not empty: pass --overwrite to replace it")
    exports = export_both(run_dir, out, step=opts.step, verifier=verifier)
    report = check_exports(
        target,
        drafter,
        target_dir,
        exports,
        prompts,
        ids=ids,
        max_new_tokens=cfg.eval.max_new_tokens,
        stop_token_ids=stop_token_ids(target.config, tok),
        block_size=opts.block_size,
        tolerance=opts.tolerance,
    )
    report["serve_commands"] = serve_commands(exports, verifier, report["block_size"])
    print(format_report(report))
    print("\nserve the exports:")
    for name, cmd in report["serve_commands"].items():
        print(f"  # {name}\n  {cmd}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


def format_report(report: dict) -> str:
    clients = [c for c in CLIENTS if report["clients"].get(c) == "ok"]
    lines = [f"block size {report['block_size']}, tolerance {report['tolerance']} tokens per step"]
    lines += [f"{c}: {report['clients'][c]}" for c in CLIENTS if c not in clients]
    lines.append("prompt  ours  " + "  ".join(clients))
    for r in report["prompts"]:
        lines.append(f"{r['id']}  {_fmt(r['ours'])}  " + "  ".join(_fmt(r.get(c)) for c in clients))
    lines.append("mean  " + "  ".join(_fmt(report["tau"].get(c)) for c in ("ours", *clients)))
    if report["failures"]:
        lines.append("FAILED:\n  " + "\n  ".join(report["failures"]))
    else:
        lines.append("passed: every client's per-prompt tau is within the tolerance of ours")
    return "\n".join(lines)


__all__ = [
    "NotComparable",
    "ServeCheckOptions",
    "check_exports",
    "compare_taus",
    "export_both",
    "main",
    "serve_commands",
    "speculators_acceptance",
    "zlab_acceptance",
]
