"""The training input pipeline: chat records -> tokenised, loss-masked, packed batches (grain).

Stages (all deterministic given the config)::

    index sources (stream, validate, count bad records)      sources.index_sources
    held-out splits (test, validation) on record groups,      splits.split_indices
      duplicated first user turns removed, before any shuffle
    MapDataset over the training records
      .shuffle(seed)            a new permutation each epoch
      .repeat(num_epochs)       None = forever
      [process_index::process_count]                          disjoint shard per host
      .map(tokenise + truncate)  lazily, with the target's chat template
    -> IterDataset (threads) [-> mp_prefetch(num_workers)]    tokenisation is the costly part
    -> first-fit packing into rows of max_length (+ bin shuffle)
    -> batches of batch_size / process_count rows, a short last batch padded with empty rows
    -> thread prefetch of `prefetch` batches

The returned iterator is a grain ``DatasetIterator``: ``get_state()`` is a JSON-serialisable
dict and ``set_state(state)`` on a freshly built pipeline continues with exactly the next batch.
Each process yields its own rows; the trainer forms global arrays with :func:`to_global_batch`.
Processes pack different documents, so with a finite ``num_epochs`` they may run out after
different numbers of batches: multi-host training should use ``num_epochs=None`` and count steps.

Documents dropped while tokenising (template failures under ``on_bad_record="skip"``, or fewer
than ``min_loss_tokens`` trained tokens after truncation) are logged with file:line and a running
count; bad records found while indexing are counted in :class:`DataReport`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from grain import experimental as grain_exp

from dflash_jax.config_io import check_fields, from_dict
from dflash_jax.data import chat, packing, splits
from dflash_jax.data import sources as data_sources
from dflash_jax.data.splits import HELDOUT_SPLITS, HeldoutSplit

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training-data settings (validated at construction; see the module docstring for stages).

    sources:        chat or pre-tokenized data: JSON/JSONL, parquet or Arrow files, datasets
                    save_to_disk directories, hf:NAME[:split] (local hub cache only), or "sharegpt"
                    (the packaged ShareGPT V3 file); record formats in data/sources.py
    max_length:     tokens per packed row; longer conversations are truncated to it
    batch_size:     global rows per step (split evenly over processes)
    seed:           record shuffle and packing-bin shuffle
    shuffle:        shuffle records (and packed rows) each epoch
    num_epochs:     passes over the data; None repeats forever
    on_bad_record:  "skip" (count, report) or "fail" (raise naming file:line)
    enable_thinking: passed to the chat template (Qwen3); None leaves the template default
    chat_template:  override the tokenizer's chat template (a Jinja string)
    eot_token:      override the detected end-of-turn token
    heldout_fraction / heldout_count: the test conversations, kept out of training for the final
                    report only (tau after training; data/splits.py): a share of the conversations
                    (stable when data is appended) or an exact number of them
    validation_fraction / validation_count: the validation conversations, also never trained on
                    and disjoint from test, for what chooses (the tau curve, recipe A/Bs); the same
                    mode as the test set's (a fraction with a fraction, a count with a count)
    heldout_seed:   seed of the held-out split (separate, so changing `seed` keeps eval prompts).
                    Held-out conversations whose first user turn duplicates another split's are
                    removed (neither trained on nor evaluated; logged)
    max_records:    read at most this many valid records (demos)
    min_loss_tokens: drop documents with fewer trained tokens after truncation (logged)
    max_skip_fraction: fail the load when more than this fraction of the records read are bad
                    (skipped under on_bad_record="skip"); the error names the top reasons
    max_wait_s:     the trainer fails when no batch arrives for this many seconds (null: wait)
    packing_bins:   rows open at once during first-fit packing (None: max(16, rows per process))
    num_workers:    tokenising worker processes (0 = in-process)
    read_threads:   tokenising threads per process
    prefetch:       buffered batches (and per-worker buffered documents)
    shards:         logical data shards, each read and packed on its own (data/shards.py); batches
                    are the same for every process count dividing it. None: the resumed
                    checkpoint's count, else one per process
    features:       a feature cache dir (``python -m dflash_jax.features``): train on its stored target
                    features and labels instead of running the target; it must match this run
                    (training/feature_cache.py), and the fields above then only describe the rows it holds
    features_minutes: a cache built for the run (``features: auto``, or ``python -m
                    dflash_jax.features``) stops after this many minutes of target forwards, or at
                    the last whole batch its disk holds, and the run trains on the rows built by
                    then (records are shuffled: a random subset of the epoch), so a slower machine
                    trains more epochs of fewer rows instead of spending its budget on features.
                    None: the whole epoch (refused before writing when the disk cannot hold it)
    """

    sources: tuple[str, ...] | str = (data_sources.SHAREGPT,)  # one path: normalised to a tuple
    max_length: int = 2048
    batch_size: int = 8
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    on_bad_record: data_sources.OnBadRecord = "skip"
    enable_thinking: bool | None = None
    chat_template: str | None = None
    eot_token: str | None = None
    heldout_fraction: float = 0.0
    heldout_count: int | None = None
    validation_fraction: float = 0.0
    validation_count: int | None = None
    heldout_seed: int = 0
    max_records: int | None = None
    min_loss_tokens: int = 1
    max_skip_fraction: float = 0.1
    max_wait_s: float | None = 900.0
    packing_bins: int | None = None
    num_workers: int = 0
    read_threads: int = 1
    prefetch: int = 2
    shards: int | None = None
    features: str | None = None
    features_minutes: float | None = None

    def __post_init__(self):
        srcs = self.sources
        if isinstance(srcs, (str, os.PathLike)):
            srcs = (srcs,)
        if not isinstance(srcs, Sequence) or not srcs:
            raise ValueError(
                f"DataConfig.sources must be a non-empty list of paths or 'sharegpt', got {srcs!r}"
            )
        object.__setattr__(self, "sources", tuple(os.fspath(s) for s in srcs))
        check_fields(self)  # types and choices; the ranges below

        def check_int(name, lo):
            v = getattr(self, name)
            if v is not None and v < lo:
                raise ValueError(f"DataConfig.{name} must be an integer >= {lo}, got {v!r}")

        check_int("max_length", 1)
        check_int("batch_size", 1)
        check_int("num_epochs", 1)
        check_int("heldout_count", 0)
        check_int("validation_count", 0)
        check_int("heldout_seed", 0)
        check_int("max_records", 1)
        check_int("min_loss_tokens", 0)
        check_int("packing_bins", 1)
        check_int("num_workers", 0)
        check_int("read_threads", 0)
        check_int("prefetch", 0)
        check_int("shards", 1)
        check_int("seed", 0)
        if self.seed >= 2**32:
            raise ValueError(f"DataConfig.seed must be < 2**32, got {self.seed}")
        if not 0.0 <= self.max_skip_fraction <= 1.0:
            raise ValueError(
                f"DataConfig.max_skip_fraction must be in [0, 1], got {self.max_skip_fraction!r}"
            )
        if self.max_wait_s is not None and self.max_wait_s <= 0:
            raise ValueError(f"DataConfig.max_wait_s must be > 0 seconds or null, got {self.max_wait_s!r}")
        if self.features_minutes is not None and not self.features_minutes > 0:
            raise ValueError(
                f"DataConfig.features_minutes must be > 0 minutes or null, got {self.features_minutes!r}"
            )
        for name in ("heldout_fraction", "validation_fraction"):
            f = getattr(self, name)
            if not 0.0 <= f < 1.0:
                raise ValueError(f"DataConfig.{name} must be in [0, 1), got {f!r}")
        if self.heldout_count is not None and self.heldout_fraction > 0:
            raise ValueError("DataConfig: set heldout_fraction or heldout_count, not both")
        if self.validation_count is not None and self.validation_fraction > 0:
            raise ValueError("DataConfig: set validation_fraction or validation_count, not both")
        counts = self.heldout_count is not None or self.validation_count is not None
        if counts and (self.heldout_fraction > 0 or self.validation_fraction > 0):
            raise ValueError(
                f"DataConfig: heldout_count={self.heldout_count}, validation_count={self.validation_count} "
                f"with heldout_fraction={self.heldout_fraction}, validation_fraction="
                f"{self.validation_fraction}: the test and validation sets are both counts or both "
                "fractions"
            )
        if self.heldout_fraction + self.validation_fraction >= 1.0:
            raise ValueError(
                f"DataConfig.heldout_fraction + DataConfig.validation_fraction must be < 1 (something left "
                f"to train on), got {self.heldout_fraction} + {self.validation_fraction}"
            )
        for name in ("chat_template", "eot_token", "features"):
            v = getattr(self, name)
            if v == "":
                raise ValueError(f"DataConfig.{name} must be a non-empty string or null, got {v!r}")

    def holds_out(self, split: str) -> bool:
        """Whether the config holds out a ``test`` or ``validation`` set."""
        if split == "test":
            return self.heldout_fraction > 0 or bool(self.heldout_count)
        if split == "validation":
            return self.validation_fraction > 0 or bool(self.validation_count)
        raise ValueError(f"unknown held-out split {split!r} (one of {HELDOUT_SPLITS})")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataConfig:
        """Build from a mapping (e.g. a YAML section) through config_io: unknown keys are an error."""
        return from_dict(cls, d)

    def rows_per_process(self, process_count: int) -> int:
        if process_count < 1 or self.batch_size % process_count:
            raise ValueError(
                f"DataConfig.batch_size={self.batch_size} is not divisible by process_count={process_count}"
            )
        return self.batch_size // process_count


@dataclasses.dataclass
class DataReport:
    """What the pipeline read and how it split it (logged by make_train_iterator)."""

    load: data_sources.LoadReport
    train_records: int
    heldout_groups: int  # test
    heldout_records: int
    validation_groups: int = 0
    validation_records: int = 0
    duplicates_removed: dict = dataclasses.field(default_factory=dict)  # split -> conversations

    def summary(self) -> str:
        return (
            f"{self.load.summary()}\ntrain records: {self.train_records}; held out: test "
            f"{self.heldout_records} records in {self.heldout_groups} conversations, validation "
            f"{self.validation_records} in {self.validation_groups}; {self.duplicates_line()}; "
            f"skipped bad records: {self.load.num_skipped}"
        )

    def duplicates_line(self) -> str:
        d = self.duplicates_removed
        return (
            f"removed {d.get('test', 0)} test and {d.get('validation', 0)} validation conversations whose "
            "first user turn duplicates another split's"
        )


# --------------------------------------------------------------------------- records and split


def _source_stamp(srcs: Sequence[str]) -> tuple:
    stamp = []
    for s in srcs:
        path, _ = data_sources.resolve_source(s)
        for f in data_sources.source_files(path):
            st = os.stat(f)
            stamp.append((f, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


@functools.lru_cache(maxsize=8)
def _cached_index(srcs: tuple[str, ...], on_bad_record: str, max_records: int | None, stamp: tuple):
    del stamp  # part of the cache key only: a changed file is re-indexed
    return data_sources.index_sources(srcs, on_bad_record=on_bad_record, max_records=max_records)


def load_index(config: DataConfig) -> tuple[data_sources.RecordIndex, data_sources.LoadReport]:
    """Index (and validate) all configured sources; cached per process while files are unchanged.

    Raises :class:`~dflash_jax.data.sources.BadDataError` when more than ``max_skip_fraction`` of
    the records read were bad (a wrong encoding or format skipped record by record)."""
    index, report = _cached_index(
        config.sources, config.on_bad_record, config.max_records, _source_stamp(config.sources)
    )
    data_sources.check_skip_fraction(report, config.max_skip_fraction, key="data.max_skip_fraction")
    return index, report


def split_records(config: DataConfig):
    """-> (train RecordIndex, ``{"test": [...], "validation": [...]}`` held-out RecordIndex per
    held-out group, DataReport). Removed duplicates are logged."""
    index, report = load_index(config)
    split = splits.split_indices(
        index.groups,
        seed=config.heldout_seed,
        test_fraction=config.heldout_fraction,
        test_count=config.heldout_count,
        validation_fraction=config.validation_fraction,
        validation_count=config.validation_count,
        prompt_keys=index.prompt_keys,
    )
    if len(split.train) == 0:
        raise data_sources.BadDataError(
            f"no training records left (sources {list(config.sources)}; {report.num_skipped} skipped)"
        )
    rep = DataReport(
        load=report,
        train_records=len(split.train),
        heldout_groups=len(split.test),
        heldout_records=int(sum(len(h) for h in split.test)),
        validation_groups=len(split.validation),
        validation_records=int(sum(len(h) for h in split.validation)),
        duplicates_removed=dict(split.removed),
    )
    if any(split.removed.values()):
        log.info("held-out split: %s", rep.duplicates_line())
    held = {
        "test": [index.subset(h) for h in split.test],
        "validation": [index.subset(h) for h in split.validation],
    }
    return index.subset(split.train), held, rep


def load_heldout_prompts(
    config: DataConfig, *, split: HeldoutSplit = "test", limit: int | None = None
) -> list[dict]:
    """Evaluation prompts from the ``split`` (``test`` or ``validation``) held-out conversations
    (never trained, by construction).

    One per held-out conversation, in split order: ``{"id", "messages", "reference"}`` where
    ``messages`` are the turns before the first assistant reply (at least one user turn) and
    ``reference`` is that reply. Held-out conversations without a user turn before a reply
    (ShareGPT continuation parts) and pre-tokenized rows give no prompt.
    """
    if split not in HELDOUT_SPLITS:
        raise ValueError(f"unknown held-out split {split!r} (one of {HELDOUT_SPLITS})")
    _, held, _ = split_records(config)
    out = []
    for h in held[split]:
        src = data_sources.RecordSource(h)
        try:
            for i in range(len(src)):
                rec = src[i]
                if "messages" not in rec:  # pre-tokenized: no conversation to prompt with
                    continue
                prompt = data_sources.prompt_messages(rec["messages"])
                if any(m["role"] == "user" for m in prompt):
                    reply = rec["messages"][len(prompt)]["content"]
                    out.append({"id": rec["id"], "messages": prompt, "reference": reply})
                    break
        finally:
            src.close()
        if limit is not None and len(out) >= limit:
            break
    return out


# --------------------------------------------------------------------------- grain pipeline


def pad_token_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return 0


def _is_round(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n in (1, 2, 5)


class NoTrainableDataError(data_sources.BadDataError):
    """Every record of a whole pass over the data was dropped: training would wait forever."""


# Why a document was dropped while tokenising -> the filter (config key) a user would change.
DROP_FILTERS = {
    "template": "the chat template (data.chat_template / the tokenizer's template)",
    "token_ids": "the token-id check (pre-tokenized ids beyond the tokenizer's vocabulary)",
    "max_length": "the length filter (data.max_length truncates away every trained token)",
    "empty_loss_mask": "the loss-mask filter (fewer assistant tokens than data.min_loss_tokens)",
}


class TokenizeRecord:
    """grain map: record -> ``{"input_ids", "loss_mask"}`` truncated, or None (skipped, logged).
    Conversations go through the chat template; pre-tokenized rows are taken as they are, refused
    when an id is beyond the tokenizer's vocabulary.

    With ``records_per_pass`` set, ``records_per_pass`` drops in a row (a whole pass over the data
    without one trainable document) raise :class:`NoTrainableDataError` naming the filters that
    dropped them, instead of silently filtering forever (``num_epochs: null``)."""

    def __init__(self, tokenizer, config: DataConfig, *, records_per_pass: int | None = None):
        self.tokenizer = tokenizer
        self.enable_thinking = config.enable_thinking
        self.chat_template = config.chat_template
        self.max_length = config.max_length
        self.min_loss_tokens = config.min_loss_tokens
        self.fail = config.on_bad_record == "fail"
        self.vocab_size = len(tokenizer)
        self.dropped: dict[str, int] = {}
        self.records_per_pass = records_per_pass
        self._in_a_row: dict[str, int] = {}  # drops by reason since the last kept document
        self._lock = threading.Lock()  # grain may call the map from several reader threads
        # Resolve once here so that an unusable template fails at construction, not mid-run.
        self.eot_token = config.eot_token or chat.end_of_turn_token(
            tokenizer, chat_template=config.chat_template
        )

    def __getstate__(self):  # grain worker processes get a pickled copy (locks do not pickle)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, rec: dict) -> dict | None:
        if "input_ids" in rec:  # pre-tokenized: trained as it is, once its ids fit the vocabulary
            ids = np.asarray(rec["input_ids"], dtype=np.int64)
            mask = np.asarray(rec["loss_mask"], dtype=bool)
            if int(ids.max()) >= self.vocab_size:
                msg = (
                    f"token id {int(ids.max())} >= the tokenizer's vocabulary ({self.vocab_size}): "
                    "tokenized for another model?"
                )
                if self.fail:
                    raise data_sources.BadRecordError(rec["origin"], "token_ids", msg)
                self._count_drop("token_ids", f"skipping record {rec['origin']}: {msg}")
                return None
            ids = ids.astype(np.int32)
        else:
            try:
                ids, mask = chat.tokenize_conversation(
                    self.tokenizer,
                    rec["messages"],
                    enable_thinking=self.enable_thinking,
                    chat_template=self.chat_template,
                    eot_token=self.eot_token,
                    tools=rec.get("tools"),
                )
            except chat.ChatTemplateError as e:
                if self.fail:
                    raise data_sources.BadRecordError(rec["origin"], "template", str(e)) from None
                self._count_drop("template", f"skipping record {rec['origin']}: {e}")
                return None
        doc = packing.truncate_document(ids, mask, self.max_length)
        n_loss = int(doc["loss_mask"].sum())
        if n_loss < self.min_loss_tokens:
            reason = "max_length" if int(np.sum(mask)) >= self.min_loss_tokens else "empty_loss_mask"
            self._count_drop(
                reason,
                f"dropping record {rec['origin']}: {n_loss} trained tokens within max_length="
                f"{self.max_length} (< min_loss_tokens={self.min_loss_tokens})",
            )
            return None
        with self._lock:
            self._in_a_row.clear()
        return doc

    def _count_drop(self, reason: str, message: str) -> None:
        # Every drop is logged; warnings at counts 1, 2, 5, 10, 20, 50, ... keep long runs readable.
        with self._lock:
            n = self.dropped[reason] = self.dropped.get(reason, 0) + 1
            self._in_a_row[reason] = self._in_a_row.get(reason, 0) + 1
            in_a_row = dict(self._in_a_row)
        level = logging.WARNING if _is_round(n) else logging.DEBUG
        log.log(level, "%s [%s drops so far in this process: %d]", message, reason, n)
        total = sum(in_a_row.values())
        if self.records_per_pass is not None and total >= self.records_per_pass:
            filters = "; ".join(
                f"{DROP_FILTERS[r]}: {k}" for r, k in sorted(in_a_row.items(), key=lambda kv: -kv[1])
            )
            raise NoTrainableDataError(
                f"no trainable document: {total} records in a row (a whole pass over the "
                f"{self.records_per_pass} training records) were dropped by {filters} "
                f"(data.max_length={self.max_length}, data.min_loss_tokens={self.min_loss_tokens})"
            )


def _ensure_absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; outside an absl app nobody parsed them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def build_train_dataset(
    config: DataConfig, tokenizer, *, process_index: int = 0, process_count: int = 1
) -> tuple[grain.IterDataset, DataReport]:
    """The packed-batch dataset for one process and what was read; see the module docstring."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
    rows = config.rows_per_process(process_count)
    train, _, report = split_records(config)
    ds = grain.MapDataset.source(data_sources.RecordSource(train))
    if config.shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(config.num_epochs)
    if process_count > 1:
        ds = ds[process_index::process_count]
    per_pass = -(-len(train) // process_count)  # the most records one process sees per epoch
    ds = ds.map(TokenizeRecord(tokenizer, config, records_per_pass=per_pass))
    it = ds.to_iter_dataset(
        grain.ReadOptions(
            num_threads=config.read_threads, prefetch_buffer_size=max(1, 4 * config.read_threads)
        )
    )
    if config.num_workers > 0:
        _ensure_absl_flags_parsed()
        it = it.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=config.num_workers, per_worker_buffer_size=max(1, config.prefetch)
            )
        )
    it = packing.pack_and_batch(
        it,
        max_length=config.max_length,
        rows=rows,
        num_bins=config.packing_bins or max(16, rows),
        pad_id=pad_token_id(tokenizer),
        seed=config.seed + 7919 * process_index,
        shuffle_bins=config.shuffle,
    )
    if config.prefetch > 0:
        it = grain_exp.ThreadPrefetchIterDataset(it, prefetch_buffer_size=config.prefetch)
    return it, report


def make_train_iterator(
    config: DataConfig, tokenizer, *, process_index: int = 0, process_count: int = 1, role: str = "training"
) -> grain.DatasetIterator:
    """Iterator of packed batches for this process: dicts of int32 numpy ``[rows, max_length]``
    arrays ``input_ids, positions, segment_ids, loss_mask`` (rows = batch_size / process_count).
    ``role`` names the data in the log ("training", "held-out").

    Supports ``get_state()`` / ``set_state(state)``; the state is JSON-serialisable.
    """
    ds, report = build_train_dataset(
        config, tokenizer, process_index=process_index, process_count=process_count
    )
    summary = report.summary() if role == "training" else report.load.summary()
    log.info("%s data (process %d/%d):\n%s", role, process_index, process_count, summary)
    return iter(ds)


def to_global_batch(batch: Mapping[str, np.ndarray], sharding) -> dict:
    """This process's rows -> global ``jax.Array``s laid out by ``sharding`` (rows over data axes)."""
    import jax

    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}
