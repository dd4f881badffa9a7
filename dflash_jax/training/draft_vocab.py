"""Choosing a drafter's reduced draft vocabulary (invariant 9, ``drafter.draft_vocab_size``).

The N ids are the target's most frequent *labels* (its argmax) at the positions the loss can train
over the run's training rows, plus every stop id of the tokenizer (the end of a reply must stay
draftable). They are chosen once, when a run starts, stored with the drafter's weights (the
``draft_vocab`` variable, in every checkpoint and export) and never recomputed on resume.

Label counts come from the offline feature cache when the run trains from one (its labels are
stored, or its final hidden states give them through lm_head), else from one pass of the frozen
target over an epoch of the training rows.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from dflash_jax.decoding.prompts import stop_token_ids
from dflash_jax.training.anchors import count_labels

log = logging.getLogger(__name__)


def choose_draft_vocab(counts: np.ndarray, size: int, always=()) -> np.ndarray:
    """int32 [size] ascending: every id of ``always`` (stop ids), then the most frequent labels
    (ties: the lower id). Ids that never occur fill the rest by id order, so a small dataset still
    gives ``size`` distinct ids."""
    counts = np.asarray(counts, np.int64)
    V = counts.shape[0]
    always = sorted({int(i) for i in always})
    bad = [i for i in always if not 0 <= i < V]
    if bad:
        raise ValueError(f"stop ids {bad} are outside the target's vocabulary of {V}")
    if not len(always) <= size <= V:
        raise ValueError(
            f"draft_vocab_size={size} must hold the {len(always)} stop ids {always} and be at most the "
            f"vocabulary ({V})"
        )
    chosen = np.zeros(V, bool)
    chosen[always] = True
    # Stable sort of -count: equal counts keep ascending id order.
    order = np.argsort(-counts, kind="stable")
    rest = order[~chosen[order]][: size - len(always)]
    chosen[rest] = True
    return np.flatnonzero(chosen).astype(np.int32)


def label_counts_from_cache(cache, vocab_size: int, lm_head=None, *, chunk: int = 1024) -> np.ndarray:
    """Label counts over one epoch of a feature cache (``feature_cache.FeatureCache``): its stored
    labels (``ce``), else the argmax of its final hidden states through ``lm_head`` [D, V]."""
    from dflash_jax.training.loss import target_argmax

    counts = None
    for shard in range(len(cache.shards)):
        mask, seg = cache.array(shard, "loss_mask"), cache.array(shard, "segment_ids")
        if "labels" in cache.names:
            labels = np.asarray(cache.array(shard, "labels"))
        else:
            if lm_head is None:
                raise ValueError("a kl feature cache stores hidden states: counting its labels needs lm_head")
            labels = np.asarray(target_argmax(np.asarray(cache.array(shard, "hidden")), lm_head, chunk=chunk))
        c = count_labels(labels, mask, seg, vocab_size)
        counts = c if counts is None else counts + c
    return counts


def label_counts_online(target, data_cfg, tokenizer, mesh, *, chunk: int, quiet=False):
    """Label counts over one epoch of ``data_cfg``'s packed rows from a frozen target pass (one
    process: a multi-process run counts from its feature cache)."""
    import jax
    from flax import nnx
    from tqdm import tqdm

    from dflash_jax.data.pipeline import to_global_batch
    from dflash_jax.data.shards import ShardedBatchIterator, resolve_num_shards
    from dflash_jax.sharding import BATCH_AXES, logical_sharding
    from dflash_jax.training.loss import target_argmax

    @nnx.jit
    def labels_of(target, batch):
        out = target(
            batch["input_ids"],
            batch["positions"],
            segment_ids=batch["segment_ids"],
            layer_ids=(),
            return_logits=False,
        )
        return target_argmax(out.hidden, target.lm_head_weight(), chunk=chunk)

    one_epoch = dataclasses.replace(data_cfg, num_epochs=1, features=None)
    rows = ShardedBatchIterator(
        one_epoch,
        tokenizer,
        num_shards=resolve_num_shards(data_cfg.shards, 1),
    )
    sharding = logical_sharding(mesh, BATCH_AXES)
    counts = np.zeros(target.config.vocab_size, np.int64)
    bar = tqdm(desc="draft vocabulary: label pass", unit="row", disable=quiet)
    try:
        with jax.set_mesh(mesh):
            for batch in rows:
                labels = jax.device_get(labels_of(target, to_global_batch(batch, sharding)))
                counts += count_labels(labels, batch["loss_mask"], batch["segment_ids"], counts.shape[0])
                bar.update(len(batch["input_ids"]))
    finally:
        bar.close()
        rows.close()
    return counts


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """The fraction of trainable label positions whose label is in ``ids``."""
    total = int(np.sum(counts))
    return float(np.sum(np.asarray(counts)[ids]) / total) if total else 1.0


def choose_for_run(
    cfg, drafter, target, tokenizer, data_cfg, mesh, *, features_dir=None, quiet=False
) -> dict:
    """Choose and install the draft vocabulary of a new run's ``drafter`` (``drafter.draft_vocab_size``):
    label counts from the feature cache ``features_dir`` when the run has one, else from a target
    pass over one epoch of ``data_cfg``. Returns a summary (size, coverage, where the counts came from)."""
    import jax

    from dflash_jax.config_io import ConfigError
    from dflash_jax.drafter.api import set_draft_vocab
    from dflash_jax.training import feature_cache

    n = drafter.config.draft_vocab_size
    V = target.config.vocab_size
    if features_dir is not None:
        cache = feature_cache.FeatureCache(features_dir)
        counts = feature_cache.label_counts(cache)
        if counts is None:
            counts = label_counts_from_cache(cache, V, target.lm_head_weight(), chunk=cfg.train.loss_chunk)
        source = f"feature cache {cache.path}"
    else:
        if jax.process_count() > 1:
            raise ConfigError(
                "drafter.draft_vocab_size in a multi-process run needs the labels of a feature cache: build one "
                "with python -m dflash_jax.features and set data.features"
            )
        counts = label_counts_online(
            target,
            data_cfg,
            tokenizer,
            mesh,
            chunk=cfg.train.loss_chunk,
            quiet=quiet,
        )
        source = "a target pass over one epoch"
    if counts.shape[0] != V:
        raise ValueError(f"label counts cover {counts.shape[0]} ids, the target's vocabulary has {V}")
    # The end of a reply must stay draftable: EOS ids and the chat template's end-of-turn token.
    stops = stop_token_ids(target.config, tokenizer, end_of_turn=True, eot_token=cfg.data.eot_token)
    ids = choose_draft_vocab(counts, n, always=stops)
    set_draft_vocab(drafter, ids)
    summary = {
        "draft_vocab_size": n,
        "label_coverage": coverage(counts, ids),
        "distinct_labels": int(np.count_nonzero(counts)),
        "labels_counted": int(np.sum(counts)),
        "stop_ids": list(stops),
        "counted_from": source,
    }
    log.info(
        "draft vocabulary: %d of %d ids (stop ids %s) cover %.2f%% of %d training labels (%d distinct), from %s",
        n,
        V,
        list(stops),
        100 * summary["label_coverage"],
        summary["labels_counted"],
        summary["distinct_labels"],
        source,
    )
    return summary
