"""The regeneration cache: train and held-out chat JSONL whose replies are the target's own.

DFlash drafters learn the target's distribution, so prompts are answered by the target itself.
With ``regen.answers: dataset`` the training prompts keep the data's own first reply (nothing is
generated for them; the labels are still the target's argmax over that text). The held-out prompts
tau is measured on (``evaluation.heldout_prompts``: the test set's and the validation set's) are
answered greedily, ``eval.max_new_tokens`` each: the test answers' text is the held-out loss's data
(``heldout.jsonl``), their token ids (``heldout_answers.json``, ``validation_answers.json``) what
tau is replayed on (``decoding.replay``). The result is cached under
``assets.cache_root()/regenerated/<digest>``, keyed by what changes the answers: the target, the
tokenizer and its template, the prompts chosen (``PROMPT_FIELDS`` of the data section and the
split's version), the generation settings (``regen.answers`` and ``regen.backend`` included, not
the server's address or concurrency) and the held-out prompts and answer length. The training
answers are appended to ``train.partial.jsonl`` as they arrive, so a run stopped while regenerating
resumes where it stopped when started again (``decoding.answer_log``); ``train.jsonl`` appears when
all are answered. With ``regen.backend: server`` a server answers the training prompts
(``decoding.regen_server``); the held-out answers are always this process's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_jax import assets
from dflash_jax.data import splits
from dflash_jax.training.run_config import RegenSection, RunConfig

log = logging.getLogger(__name__)

# The DataConfig fields that decide which prompts are answered and how they are rendered; the rest
# (batch size, packing, epochs, where features come from, ...) leave the answers unchanged.
PROMPT_FIELDS = (
    "sources",
    "on_bad_record",
    "max_records",
    "heldout_fraction",
    "heldout_count",
    "validation_fraction",
    "validation_count",
    "heldout_seed",
    "enable_thinking",
    "chat_template",
)


# How the answers are fetched, not what they are: left out of the key, so a run can move to more
# servers, or resume with another concurrency, and keep its cache.
TRANSPORT_FIELDS = ("base_urls", "concurrency", "timeout_s", "retries")
# Fields added to RegenSection after caches existed: in the key only when set, so those stay valid.
LATER_FIELDS = ("backend", "model", "turns", "keep_reasoning")


def _regen_key_fields(cfg: RunConfig) -> dict:
    default = RegenSection()
    fields = dataclasses.asdict(cfg.regen)
    return {
        k: v
        for k, v in fields.items()
        if k not in TRANSPORT_FIELDS and not (k in LATER_FIELDS and v == getattr(default, k))
    }


def _stamp(directory: Path) -> list:
    """(name, size, mtime) of the files that define a model directory (``assets.model_files``)."""
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in assets.model_files(directory)]


def regen_key(cfg: RunConfig, tokenizer, target_dir: Path) -> str:
    """The digest naming a run's regenerated data: what changes the answers, nothing else."""
    key = json.dumps(
        {
            "target": str(Path(target_dir).resolve()),
            "target_files": _stamp(Path(target_dir)),  # same path, new weights: a new key
            "target_dtype": cfg.target.dtype,  # greedy answers differ between float32 and bfloat16
            "tokenizer": [getattr(tokenizer, "name_or_path", ""), len(tokenizer), tokenizer.chat_template],
            "data": {k: getattr(cfg.data, k) for k in PROMPT_FIELDS},
            "regen": _regen_key_fields(cfg),
            "eval": [cfg.eval.num_prompts, cfg.eval.max_prompt_tokens, cfg.eval.max_new_tokens],
            "validation_prompts": cfg.eval.validation_prompts,
            "split": splits.VERSION,  # the same fields put other records where
            "heldout": "greedy answers to the eval prompts, ids kept",
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HeldoutAnswers:
    """The target's greedy answers (token ids, a final stop token included) to the eval prompts,
    ``max_new_tokens`` at most, and the seconds its plain decoder took for them."""

    prompts: tuple
    answers: tuple
    max_new_tokens: int
    seconds: float

    @classmethod
    def read(cls, path: Path) -> HeldoutAnswers:
        d = json.loads(Path(path).read_text())
        return cls(
            prompts=tuple(tuple(p) for p in d["prompts"]),
            answers=tuple(tuple(a) for a in d["answers"]),
            max_new_tokens=int(d["max_new_tokens"]),
            seconds=float(d["seconds"]),
        )

    def write(self, path: Path) -> None:
        d = {
            "prompts": [list(p) for p in self.prompts],
            "answers": [list(a) for a in self.answers],
            "max_new_tokens": self.max_new_tokens,
            "seconds": self.seconds,
        }
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(d))
        tmp.replace(path)


def regenerated_data(
    cfg: RunConfig, target, tokenizer, target_dir: Path, heldout_prompts, validation_prompts=()
) -> tuple[Path, Path, Path, Path]:
    """-> (train JSONL, held-out JSONL, test answers JSON, validation answers JSON), generated once
    per content key and reused after. ``heldout_prompts`` / ``validation_prompts``: (messages, ids)
    of the test / validation prompts (``evaluation.heldout_prompts``)."""
    from dflash_jax.data import sources
    from dflash_jax.data.pipeline import split_records
    from dflash_jax.decoding.regeneration import (
        InProcess,
        RegenReport,
        Server,
        answer_prompts,
        dataset_replies,
        regenerate_file,
    )
    from dflash_jax.decoding.sampling import SamplingConfig

    r = cfg.regen
    out_dir = assets.cache_root() / "regenerated" / regen_key(cfg, tokenizer, target_dir)
    train_path, held_path = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    answers_path, val_path = out_dir / "heldout_answers.json", out_dir / "validation_answers.json"
    paths = (train_path, held_path, answers_path, val_path)
    if all(p.is_file() for p in paths):
        log.info("using cached regenerated data in %s", out_dir)
        return paths
    backend = None
    if r.answers == "target" and r.backend == "server":
        # Before anything is generated: a server of another model is refused at no cost.
        backend = Server.connect(r, target_dir, tokenizer, cfg.data.enable_thinking)
    elif r.answers == "target":
        backend = InProcess(
            target,
            max_new_tokens=r.max_new_tokens,
            batch_size=r.batch_size,
            sampling=SamplingConfig(temperature=r.temperature),
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    train_idx, _, _ = split_records(cfg.data)
    src = sources.RecordSource(train_idx)
    try:
        n = min(len(src), r.num_prompts)
        train_records = [src[i] for i in range(n)]
    finally:
        src.close()

    def answer(split: str, prompts):
        t0 = time.perf_counter()
        texts, answers = answer_prompts(
            target,
            tokenizer,
            [
                (f"{'heldout' if split == 'test' else split}-{i}", m, ids)
                for i, (m, ids) in enumerate(prompts)
            ],
            report=RegenReport(),
            max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=r.batch_size,
            desc=f"{split} answers",
        )
        seconds = time.perf_counter() - t0
        n_tok = sum(map(len, answers))
        log.info(
            "%s: the target's greedy answers to %d prompts (%d tokens in %.0f s, %.0f tokens/s; %d empty)",
            split,
            len(answers),
            n_tok,
            seconds,
            n_tok / max(seconds, 1e-9),
            len(answers) - len(texts),
        )
        return texts, HeldoutAnswers(
            prompts=tuple(tuple(ids) for _, ids in prompts),
            answers=tuple(tuple(a) for a in answers),
            max_new_tokens=cfg.eval.max_new_tokens,
            seconds=seconds,
        )

    # The held-out answers come from this process whatever regen.backend says: tau is replayed on
    # their token ids exactly as generated, which a server's text does not give back. They are few,
    # and kept when an interrupted run already wrote them.
    if not all(p.is_file() for p in (held_path, answers_path, val_path)):
        held, test_answers = answer("test", heldout_prompts)
        _, validation_answers = (
            answer("validation", validation_prompts) if validation_prompts else (None, None)
        )
        sources.write_chat_jsonl(held_path, held)
        test_answers.write(answers_path)
        (validation_answers or HeldoutAnswers((), (), cfg.eval.max_new_tokens, 0.0)).write(val_path)
    if backend is None:
        train, rep_t = dataset_replies(
            tokenizer,
            train_records,
            max_prompt_tokens=r.max_prompt_tokens,
            enable_thinking=cfg.data.enable_thinking,
        )
        sources.write_chat_jsonl(train_path, train)  # last: its presence says the rest is complete
    else:
        # Appended as answered; a run stopped part-way resumes from it on the next start.
        partial = out_dir / "train.partial.jsonl"
        rep_t = regenerate_file(
            partial,
            train_records,
            tokenizer,
            backend,
            resume=True,
            max_prompt_tokens=r.max_prompt_tokens,
            enable_thinking=cfg.data.enable_thinking,
            keep_reasoning=r.keep_reasoning,
        )
        partial.replace(train_path)  # last: its presence says the rest is complete
    log.info("train: %s", rep_t.summary())
    return paths


def data_configs(cfg: RunConfig, train_path: Path, held_path: Path):
    """-> (training DataConfig, held-out DataConfig) reading the regenerated files; the held-out one
    is None when no held-out prompt was answered (the run then has no held-out loss, says so, and
    still measures tau on its prompts)."""
    from dflash_jax.data.sources import BadDataError

    if train_path.stat().st_size == 0:
        raise BadDataError(
            f"{train_path}: no training prompt of the first regen.num_prompts={cfg.regen.num_prompts} "
            f"records was kept (each needs a user turn, a prompt of at most "
            f"regen.max_prompt_tokens={cfg.regen.max_prompt_tokens} tokens and a non-empty reply)"
        )
    data_cfg = dataclasses.replace(
        cfg.data,
        sources=(str(train_path),),
        heldout_fraction=0.0,
        heldout_count=None,
        validation_fraction=0.0,
        validation_count=None,
        max_records=None,
    )
    if held_path.stat().st_size == 0:
        if cfg.eval.num_prompts == 0:
            return data_cfg, None
        log.warning(
            "held-out: none of the eval.num_prompts=%d held-out prompts was answered (each needs a user "
            "turn and at most eval.max_prompt_tokens=%d tokens): no held-out loss in this run",
            cfg.eval.num_prompts,
            cfg.eval.max_prompt_tokens,
        )
        return data_cfg, None
    heldout_cfg = dataclasses.replace(
        data_cfg, sources=(str(held_path),), batch_size=min(4, cfg.data.batch_size)
    )
    return data_cfg, heldout_cfg
