"""The regeneration cache: train and held-out chat JSONL whose replies are the target's own.

DFlash drafters learn the target's distribution, so prompts are answered by the target itself.
With ``regen.answers: dataset`` the training prompts keep the data's own first reply (nothing is
generated for them; the labels are still the target's argmax over that text) and only the held-out
prompts are answered by the target. The result is cached under
``assets.cache_root()/regenerated/<digest>``, keyed by what changes the answers: the target, the
tokenizer and its template, the prompts chosen (``PROMPT_FIELDS`` of the data section), the
generation settings (``regen.answers`` included) and the held-out prompt count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from dflash_jax import assets
from dflash_jax.training.run_config import RunConfig

log = logging.getLogger(__name__)

# The DataConfig fields that decide which prompts are answered and how they are rendered; the rest
# (batch size, packing, epochs, where features come from, ...) leave the answers unchanged.
PROMPT_FIELDS = (
    "sources",
    "on_bad_record",
    "max_records",
    "heldout_fraction",
    "heldout_count",
    "heldout_seed",
    "enable_thinking",
    "chat_template",
)


def _stamp(directory: Path) -> list:
    """(name, size, mtime) of the files that define a model directory."""
    files = sorted(p for p in directory.iterdir() if p.suffix in (".json", ".safetensors", ".gguf"))
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def regen_key(cfg: RunConfig, tokenizer, target_dir: Path) -> str:
    """The digest naming a run's regenerated data: what changes the answers, nothing else."""
    key = json.dumps(
        {
            "target": str(Path(target_dir).resolve()),
            "target_files": _stamp(Path(target_dir)),  # same path, new weights: a new key
            "tokenizer": [getattr(tokenizer, "name_or_path", ""), len(tokenizer), tokenizer.chat_template],
            "data": {k: getattr(cfg.data, k) for k in PROMPT_FIELDS},
            "regen": dataclasses.asdict(cfg.regen),
            "eval": [cfg.eval.num_prompts, cfg.eval.max_prompt_tokens],
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def regenerated_data(cfg: RunConfig, target, tokenizer, target_dir: Path) -> tuple[Path, Path]:
    """-> (train JSONL, held-out JSONL), generated once per content key and reused after."""
    from dflash_jax.data import sources
    from dflash_jax.data.pipeline import load_heldout_prompts, split_records
    from dflash_jax.decoding.regeneration import dataset_replies, regenerate_records
    from dflash_jax.decoding.sampling import SamplingConfig

    r = cfg.regen
    out_dir = assets.cache_root() / "regenerated" / regen_key(cfg, tokenizer, target_dir)
    train_path, held_path = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    if train_path.is_file() and held_path.is_file():
        log.info("using cached regenerated data in %s", out_dir)
        return train_path, held_path
    out_dir.mkdir(parents=True, exist_ok=True)
    train_idx, _, _ = split_records(cfg.data)
    src = sources.RecordSource(train_idx)
    try:
        n = min(len(src), r.num_prompts)
        train_records = [src[i] for i in range(n)]
    finally:
        src.close()
    held_records = load_heldout_prompts(cfg.data, limit=cfg.eval.num_prompts)
    common = dict(
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
        sampling=SamplingConfig(temperature=r.temperature),
        enable_thinking=cfg.data.enable_thinking,
    )
    held, rep_h = regenerate_records(
        target, tokenizer, held_records, max_prompt_tokens=cfg.eval.max_prompt_tokens, **common
    )
    if r.answers == "dataset":
        train, rep_t = dataset_replies(
            tokenizer,
            train_records,
            max_prompt_tokens=r.max_prompt_tokens,
            enable_thinking=cfg.data.enable_thinking,
        )
    else:
        train, rep_t = regenerate_records(
            target, tokenizer, train_records, max_prompt_tokens=r.max_prompt_tokens, **common
        )
    log.info("held-out: %s", rep_h.summary())
    log.info("train: %s", rep_t.summary())
    sources.write_chat_jsonl(held_path, held)
    sources.write_chat_jsonl(train_path, train)
    return train_path, held_path


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
        cfg.data, sources=(str(train_path),), heldout_fraction=0.0, heldout_count=None, max_records=None
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
