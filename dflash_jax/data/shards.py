"""Logical data shards: global batches that do not depend on how many processes read them.

The training records are split into ``S`` logical shards (``data.shards``); each shard is read,
tokenised and packed by its own pipeline (:func:`pipeline.build_train_dataset` with shard index
``s`` of ``S``) and contributes ``batch_size / S`` rows to every global batch, in shard order.
With ``P`` processes, process ``p`` reads only shards ``p*S/P .. (p+1)*S/P - 1`` and its rows are
exactly the global batch's rows ``p*B/P .. (p+1)*B/P - 1``::

    S = 2, B = 8     shard 0 -> rows 0-3, shard 1 -> rows 4-7
    1 process:       process 0 reads shards 0, 1        (8 rows)
    2 processes:     process 0 reads shard 0 (rows 0-3), process 1 reads shard 1 (rows 4-7)

so a run's batches, and its losses, are the same on 1 x 8 and 2 x 4 devices, and a checkpoint's
data state (one grain state per shard) resumes on any process count that divides ``S``.
"""

from __future__ import annotations

import logging

import numpy as np

from dflash_jax.data.pipeline import DataConfig, build_train_dataset

log = logging.getLogger(__name__)


def shards_of_process(num_shards: int, process_index: int, process_count: int) -> range:
    """The logical shards process ``process_index`` of ``process_count`` reads."""
    if num_shards < 1 or num_shards % process_count:
        raise ValueError(
            f"data.shards={num_shards} must be a positive multiple of the number of processes "
            f"({process_count}): every process reads the same number of shards"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, {process_count})")
    per = num_shards // process_count
    return range(process_index * per, (process_index + 1) * per)


def resolve_num_shards(configured: int | None, process_count: int, saved_state: dict | None = None) -> int:
    """``data.shards`` if set; else the shard count of the checkpoint being resumed; else one
    shard per process. A configured count that differs from the checkpoint's is an error (the
    data order would silently change)."""
    saved = _normalise(saved_state)["num_shards"] if saved_state is not None else None
    if configured is not None and saved is not None and configured != saved:
        raise ValueError(
            f"data.shards={configured} but the checkpoint's data state has {saved} shards: "
            f"resume with data.shards={saved} (or leave it unset)"
        )
    return configured or saved or process_count


class ShardedBatchIterator:
    """This process's rows of every global batch: its logical shards' batches, concatenated.

    ``get_state()`` covers only this process's shards; merge all processes' states with
    :func:`merge_states` before saving, and any process count that divides ``num_shards`` can
    ``set_state`` from the merged state.
    """

    def __init__(
        self,
        config: DataConfig,
        tokenizer,
        *,
        num_shards: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.shard_ids = shards_of_process(num_shards, process_index, process_count)
        if config.batch_size % num_shards:  # every shard gives each batch the same number of rows
            raise ValueError(f"data.shards={num_shards} does not divide data.batch_size={config.batch_size}")
        self.num_shards = num_shards
        self._iters = []
        for s in self.shard_ids:
            ds, report = build_train_dataset(config, tokenizer, process_index=s, process_count=num_shards)
            self._iters.append(iter(ds))
        log.info(
            "training data: shards %d-%d of %d on process %d/%d\n%s",
            self.shard_ids[0],
            self.shard_ids[-1],
            num_shards,
            process_index,
            process_count,
            report.summary(),
        )

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        parts = [next(it) for it in self._iters]
        return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}

    def get_state(self) -> dict:
        return {
            "num_shards": self.num_shards,
            "shards": {str(s): it.get_state() for s, it in zip(self.shard_ids, self._iters, strict=True)},
        }

    def set_state(self, state: dict) -> None:
        state = _normalise(state)
        if state["num_shards"] != self.num_shards:
            raise ValueError(f"data state has {state['num_shards']} shards, this pipeline {self.num_shards}")
        missing = [s for s in self.shard_ids if str(s) not in state["shards"]]
        if missing:
            raise ValueError(
                f"data state has no position for shards {missing} (was it merged over processes?)"
            )
        for s, it in zip(self.shard_ids, self._iters, strict=True):
            it.set_state(state["shards"][str(s)])

    def close(self) -> None:
        for it in self._iters:
            close = getattr(it, "close", None)
            if close is not None:
                close()


def merge_states(states: list[dict]) -> dict:
    """One data state from every process's :meth:`ShardedBatchIterator.get_state`."""
    states = [_normalise(s) for s in states]
    counts = {s["num_shards"] for s in states}
    if len(counts) != 1:
        raise ValueError(f"processes disagree on the number of data shards: {sorted(counts)}")
    merged = {}
    for s in states:
        merged.update(s["shards"])
    return {"num_shards": counts.pop(), "shards": dict(sorted(merged.items(), key=lambda kv: int(kv[0])))}


def _normalise(state: dict) -> dict:
    """A checkpoint from before logical shards holds one grain state: that of shard 0 of 1."""
    if isinstance(state, dict) and "num_shards" in state and "shards" in state:
        return state
    return {"num_shards": 1, "shards": {"0": state}}
