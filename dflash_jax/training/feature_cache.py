"""The offline feature cache: the frozen target's outputs over one epoch of packed rows, on disk.

DFlash drafters train for many epochs over the same rows, and the target forward is most of a
step's work; ``python -m dflash_jax.features`` (the writer, ``dflash_jax/features.py``) runs the
target once and this module owns the format that it writes and that ``data.features: DIR`` reads.

Layout of ``DIR``::

    manifest.json              format version, what the rows are and what made them (below)
    00000-input_ids.npy        shard 0: int32 [rows, T]
    00000-positions.npy        int32 [rows, T]
    00000-segment_ids.npy      int32 [rows, T]
    00000-loss_mask.npy        int32 [rows, T]
    00000-features.npy         [rows, T, K*H] the raw outputs of the taps, concatenated in tap order
    00000-labels.npy           int32 [rows, T], the target's argmax at each position (in the target's
                               own dtype; ``ce`` trains on it, and both losses leave out a slot
                               whose label a draft vocabulary lacks)
    00000-hidden.npy           train.loss kl: [rows, T, H], the final normed hidden state (the loss
                               recomputes the target's logits from it through lm_head: exact, and
                               H values per position instead of a top-k approximation)
    00001-...

Rows are stored in training order: global batch ``b`` is rows ``b*B .. (b+1)*B - 1`` (``B`` =
``data.batch_size``), the batches the online pipeline yields in its first epoch (its last batch
padded with empty rows as online). Epoch 0 replays them in that order, so training from the cache
equals online training; later epochs draw the same rows in a permutation seeded by ``data.seed``
(when ``data.shuffle``). Process ``p`` of ``P`` reads rows ``p*B/P .. (p+1)*B/P - 1`` of each batch.
bfloat16 arrays are stored as their uint16 bits (``.npy`` has no bfloat16); the manifest names the
dtype. Shards are opened memory-mapped.

The manifest's ``identity`` says what made the rows: the target (config and a content hash of its
files, and the dtype it ran in), the taps, the tokenizer (name, size, chat-template hash), every
data setting that changes the packed rows (with a content hash of the data files) and what the
labels are. A run refuses a cache whose identity differs from its own, naming each field and both
values (:func:`check_identity`).

Before a byte is written the build checks the disk (:func:`check_disk`): the rows times the bytes a
row stores (:func:`row_bytes`) against the free space of the filesystem that will hold ``DIR``. A
bound (one document a row) is tried first; when it does not fit, the epoch's packed rows are
counted (tokenising, no target forward). A build that would not fit is refused, naming the
directory, both sizes, ``$DFLASH_JAX_CACHE`` and how to cut the size; under
``data.features_minutes`` it builds the whole batches that fit instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import numpy as np

from dflash_jax.assets import file_sha256, model_files
from dflash_jax.cli import UserError
from dflash_jax.config_io import ConfigError
from dflash_jax.dtypes import to_dtype
from dflash_jax.nested import flatten

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ROW_ARRAYS = ("input_ids", "positions", "segment_ids", "loss_mask")
# DataConfig fields that do not change the packed rows of one epoch (num_epochs: the cache holds
# one; the rest are throughput, patience, or where features come from).
NOT_ROW_FIELDS = (
    "num_epochs",
    "max_skip_fraction",
    "max_wait_s",
    "num_workers",
    "read_threads",
    "prefetch",
    "features",
)
_HASH_WHOLE = 8 << 20  # files up to this size are hashed whole, larger ones at three 1 MiB samples
_SAMPLE = 1 << 20


class FeatureCacheError(UserError):
    """A feature cache that is missing, unreadable, corrupt, or made for another run."""


class CacheDiskError(FeatureCacheError):
    """A feature cache that would not fit the free space of its filesystem (refused unwritten)."""


# --------------------------------------------------------------------------- fingerprints


def file_digest(path: Path) -> str:
    """sha256 of a file: whole when small, else of its size and three 1 MiB samples (start, middle,
    end), so multi-GB weights are fingerprinted in milliseconds, independent of path and mtime."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _HASH_WHOLE:
            h.update(f.read())
        else:
            for offset in (0, size // 2, size - _SAMPLE):
                f.seek(offset)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()[:16]


def target_fingerprint(target_dir: Path, dtype: str) -> dict:
    """The files that define the target (``assets.model_files``) by content, and the dtype it ran in."""
    return {"dtype": dtype, "files": {p.name: file_digest(p) for p in model_files(target_dir)}}


def tokenizer_fingerprint(tokenizer) -> dict:
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    return {
        "name": Path(str(getattr(tokenizer, "name_or_path", ""))).name,
        "vocab_size": len(tokenizer),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16],
    }


def data_fingerprint(data_cfg) -> dict:
    """Every DataConfig setting that changes the packed rows, sources by content (name and hash)."""
    from dflash_jax.data.sources import resolve_source

    out = {
        f.name: getattr(data_cfg, f.name)
        for f in dataclasses.fields(data_cfg)
        if f.name not in NOT_ROW_FIELDS and f.name != "sources"
    }
    # A time-capped build holds a prefix of the epoch, so the cap names its rows; uncapped caches
    # keep the identity (and the auto directory) they had before the field existed.
    if out.get("features_minutes") is None:
        out.pop("features_minutes", None)
    # Likewise without a validation set: the training records are those of before it existed.
    if not out.get("validation_count") and not out.get("validation_fraction"):
        out.pop("validation_count", None)
        out.pop("validation_fraction", None)
    out["sources"] = [_source_digest(resolve_source(s)[0]) for s in data_cfg.sources]
    return out


def _source_digest(path: str) -> str:
    """``name:hash`` of a data source: a file's digest (as before tables existed), or of a table
    directory's / hub dataset's files together."""
    from dflash_jax.data.sources import source_files

    files = source_files(path)
    if files == [path]:
        return f"{Path(path).name}:{file_digest(Path(path))}"
    h = hashlib.sha256()
    for f in files:
        name = os.path.relpath(f, path) if os.path.isdir(path) else Path(f).name
        h.update(f"{name}:{file_digest(Path(f))}\n".encode())
    return f"{Path(path).name}:{h.hexdigest()[:16]}"


def labels_identity(train_cfg) -> dict:
    """What the label arrays are: the target's argmax in its own dtype (part of the target's
    fingerprint), whatever the drafter computes in, for either loss, plus the final hidden state
    under ``kl``. ``argmax_dtype`` tells them from the caches of earlier versions: ``ce`` ones took
    the argmax in ``train.compute_dtype``, ``kl`` ones did not store it."""
    return {"loss": train_cfg.loss, "argmax_dtype": "target"}


def run_identity(cfg, data_cfg, target_dir: Path, tokenizer, taps) -> dict:
    """What a run needs its cache to have been made from (compared field by field)."""
    return {
        "target": target_fingerprint(target_dir, cfg.target.dtype),
        "taps": [int(t) for t in taps],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data": data_fingerprint(data_cfg),
        "labels": labels_identity(cfg.train),
    }


def check_identity(cache_identity: dict, run: dict, where: str) -> None:
    """Raise naming every field where the cache at ``where`` and the run disagree, with both values."""
    a = flatten(cache_identity, empty_as_leaf=True)
    b = flatten(json.loads(json.dumps(run, default=str)), empty_as_leaf=True)
    wrong = [k for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]
    if wrong:
        detail = "; ".join(
            f"{k}: cache has {a.get(k, '<absent>')!r}, this run has {b.get(k, '<absent>')!r}" for k in wrong
        )
        raise FeatureCacheError(
            f"feature cache {where} was made for another run ({detail}); rebuild it with "
            "python -m dflash_jax.features for this config, or unset data.features"
        )


# --------------------------------------------------------------------------- disk

# Judgement, not measurement: room kept beyond the arrays for the .npy headers, the manifest (its
# label counts reach ~25 bytes per vocabulary entry) and whatever else writes to the disk meanwhile.
DISK_MARGIN = 0.02  # of the cache's bytes
DISK_MARGIN_MIN = 256 << 20


def row_bytes(*, seq_len: int, hidden_size: int, num_taps: int, dtype, loss: str) -> dict[str, int]:
    """The bytes one cached row stores, per array, as :func:`write_cache` stores them: the four row
    arrays and the labels as int32 ``[T]``, the taps' features ``[T, K*H]`` and, under ``kl``, the
    final hidden state ``[T, H]`` in ``dtype`` (the stored dtype: the target's unless --dtype)."""
    item = to_dtype(dtype).itemsize
    out = {name: 4 * seq_len for name in ROW_ARRAYS}
    out["features"] = seq_len * num_taps * hidden_size * item
    out["labels"] = 4 * seq_len
    if loss == "kl":
        out["hidden"] = seq_len * hidden_size * item
    return out


def human_size(n: float) -> str:
    """Disk sizes in decimal units, as disk vendors count them: '168 MB', '3.36 TB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def free_bytes(path: str | Path) -> tuple[Path, int]:
    """(the nearest existing directory at or above ``path``, the bytes free to this user on its
    filesystem): where a cache that does not exist yet will be written."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p, int(shutil.disk_usage(p).free)


def bound_rows(records: int, batch_size: int, num_shards: int = 1) -> int:
    """The most rows one epoch of ``records`` documents packs into: each document fills at most one
    row (it is truncated to the row), each logical shard packs its own ``records / num_shards``, and
    the last batch is padded to ``batch_size`` rows."""
    per_shard = math.ceil(records / num_shards)
    return math.ceil(per_shard / (batch_size // num_shards)) * batch_size


def count_rows(data_cfg, tokenizer, num_shards: int) -> int:
    """The rows of one epoch of ``data_cfg``, counted by packing it (tokenising; no target)."""
    from dflash_jax.data.shards import ShardedBatchIterator

    one_epoch = dataclasses.replace(data_cfg, num_epochs=1, features=None)
    rows = ShardedBatchIterator(one_epoch, tokenizer, num_shards=num_shards)
    try:
        return sum(len(batch["input_ids"]) for batch in rows)
    finally:
        rows.close()


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """What a cache of ``rows`` rows of ``per_row`` bytes (per array) needs, against the ``free``
    bytes of the filesystem of ``directory`` (the nearest existing directory above the cache).
    ``exact``: the rows were counted; else they are the bound of :func:`bound_rows`."""

    directory: Path
    rows: int
    per_row: dict
    free: int
    exact: bool = False

    @property
    def bytes_per_row(self) -> int:
        return sum(self.per_row.values())

    @property
    def need(self) -> int:
        return self.rows * self.bytes_per_row

    @property
    def margin(self) -> int:
        return max(math.ceil(DISK_MARGIN * self.need), DISK_MARGIN_MIN)

    @property
    def fits(self) -> bool:
        return self.need + self.margin <= self.free

    @property
    def rows_that_fit(self) -> int:
        """The most rows the free space holds with the margin."""
        room = min(self.free - DISK_MARGIN_MIN, self.free / (1 + DISK_MARGIN))
        return max(0, int(room // self.bytes_per_row))

    def summary(self) -> str:
        rows = f"{self.rows:,} rows" if self.exact else f"at most {self.rows:,} rows"
        return (
            f"{rows} x {human_size(self.bytes_per_row)} = {human_size(self.need)} "
            f"(+ {human_size(self.margin)} margin); {human_size(self.free)} free on {self.directory}"
        )


def size_advice(size: CacheSize, *, seq_len: int, loss: str, dtype) -> str:
    """How to make room or store less (the error of :func:`check_disk`, ``train --plan``)."""
    from dflash_jax import assets

    root = assets.cache_root() / "features"
    cuts = [
        "fewer rows (data.max_records=N; with regen, regen.num_prompts=N)",
        f"shorter rows (data.max_length, now {seq_len}: a row's bytes scale with it)",
        "a time cap on the build (data.features_minutes=M: it then writes the whole batches that fit)",
    ]
    if loss == "kl":
        cuts.append(f"train.loss=ce (no hidden state: {human_size(size.per_row['hidden'])} a row less)")
    if to_dtype(dtype).itemsize > 2:
        cuts.append("python -m dflash_jax.features --dtype bfloat16 (half the features' bytes)")
    return (
        f"the free space holds about {size.rows_that_fit:,} rows. Make room, or build on a larger disk: "
        f"data.features: auto builds under ${assets.CACHE_ENV}/features (now {root}); set "
        f"{assets.CACHE_ENV} to a directory there, or build with python -m dflash_jax.features --out DIR "
        f"and train with data.features=DIR. Or store less: {'; '.join(cuts)}"
    )


def check_disk(out, per_row: dict, data_cfg, tokenizer, *, loss: str, dtype) -> int | None:
    """The disk pre-flight of a build into ``out``, before anything is written: the bound of one
    document a row first, the counted rows when the bound does not fit. Returns the most rows the
    build may write: None when the whole epoch fits; under ``data.features_minutes`` the whole
    batches that fit; otherwise refuses (:class:`CacheDiskError`)."""
    from dflash_jax.data.pipeline import split_records
    from dflash_jax.data.shards import resolve_num_shards

    directory, free = free_bytes(out)
    num_shards = resolve_num_shards(data_cfg.shards, 1)
    _, _, report = split_records(data_cfg)
    rows = bound_rows(report.train_records, data_cfg.batch_size, num_shards)
    size = CacheSize(directory, rows, per_row, free)
    if not size.fits:
        log.info("feature cache %s: %s; counting the epoch's packed rows", out, size.summary())
        size = dataclasses.replace(size, rows=count_rows(data_cfg, tokenizer, num_shards), exact=True)
    log.info("feature cache %s: %s", out, size.summary())
    if size.fits:
        return None
    batch = data_cfg.batch_size
    limit = size.rows_that_fit // batch * batch
    if data_cfg.features_minutes is not None and limit >= batch:
        log.warning(
            "feature cache %s: the epoch's %d rows do not fit the free space; under "
            "data.features_minutes the build stops at %d rows (what fits)",
            *(out, size.rows, limit),
        )
        return limit
    raise CacheDiskError(
        f"feature cache {Path(out).expanduser().absolute()}: {size.summary()}: it does not fit, "
        f"nothing written; {size_advice(size, seq_len=data_cfg.max_length, loss=loss, dtype=dtype)}"
    )


# --------------------------------------------------------------------------- writing


def dtype_name(dtype) -> str:
    return "bfloat16" if np.dtype(dtype).name == "bfloat16" else np.dtype(dtype).name


def _save(path: Path, array: np.ndarray) -> None:
    if dtype_name(array.dtype) == "bfloat16":
        array = array.view(np.uint16)
    np.save(path, np.ascontiguousarray(array), allow_pickle=False)


def refuse_existing(out, overwrite: bool) -> Path:
    """``out`` resolved; refused when it exists and ``overwrite`` is not set."""
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        raise FeatureCacheError(
            f"{out} already exists: pass --overwrite to replace it, or choose another --out"
        )
    return out


class CacheWriter:
    """Writes shards of ``rows_per_shard`` rows into a temporary sibling of ``out``; :meth:`finish`
    writes the manifest and renames it to ``out`` (so ``out`` is either complete or absent)."""

    def __init__(self, out: Path, *, rows_per_shard: int, overwrite: bool = False):
        self.out = refuse_existing(out, overwrite)
        self.overwrite = overwrite
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.rows_per_shard = rows_per_shard
        self.shards: list[dict] = []
        self.dtypes: dict[str, str] = {}
        self._pending: list[dict] = []
        self._pending_rows = 0
        self.rows = 0

    def add(self, batch: dict) -> None:
        """One global batch of numpy arrays, all with the same leading (row) dimension."""
        self._pending.append(batch)
        self._pending_rows += len(batch["input_ids"])
        self.rows += len(batch["input_ids"])
        if self._pending_rows >= self.rows_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self.shards)
        files = {}
        for name in self._pending[0]:
            array = np.concatenate([b[name] for b in self._pending], axis=0)
            self.dtypes[name] = dtype_name(array.dtype)
            path = self.tmp / f"{index:05d}-{name}.npy"
            _save(path, array)
            files[name] = {
                "file": path.name,
                "bytes": path.stat().st_size,
                "shape": list(array.shape),
                "sha256": file_sha256(path),  # checked when the shard is first read
            }
        self.shards.append({"rows": self._pending_rows, "files": files})
        self._pending, self._pending_rows = [], 0

    def finish(self, manifest: dict) -> Path:
        self._flush()
        if not self.shards:
            raise FeatureCacheError("the training data yielded no batch: nothing to cache")
        manifest = {
            "format_version": FORMAT_VERSION,
            **manifest,
            "rows": self.rows,
            "dtypes": self.dtypes,
            "shards": self.shards,
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# --------------------------------------------------------------------------- reading


class FeatureCache:
    """A cache directory, checked when opened: manifest readable and of this format, every shard
    file present with the size and shape the manifest records. Rows are read memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise FeatureCacheError(
                f"data.features={path}: no {MANIFEST} there (build the cache with python -m dflash_jax.features)"
            )
        try:
            self.manifest = json.loads(manifest_path.read_text())
            version = self.manifest["format_version"]
        except (ValueError, KeyError) as e:
            raise FeatureCacheError(f"{manifest_path} is not a feature cache manifest ({e})") from None
        if version != FORMAT_VERSION:
            raise FeatureCacheError(
                f"{manifest_path} has format_version {version!r}; this version reads {FORMAT_VERSION}: rebuild the cache"
            )
        try:
            self.shards = self.manifest["shards"]
            self.dtypes = self.manifest["dtypes"]
            self.rows = int(self.manifest["rows"])
            self.batch_size = int(self.manifest["batch_size"])
            self.identity = self.manifest["identity"]
        except (KeyError, TypeError, ValueError) as e:
            raise FeatureCacheError(f"{manifest_path} lacks field {e}") from None
        for shard in self.shards:
            for name, entry in shard["files"].items():
                f = self.path / entry["file"]
                if not f.is_file():
                    raise FeatureCacheError(
                        f"feature cache {self.path}: shard file {entry['file']} ({name}) is missing"
                    )
                if f.stat().st_size != entry["bytes"]:
                    raise FeatureCacheError(
                        f"feature cache {self.path}: shard file {entry['file']} has {f.stat().st_size} bytes, "
                        f"the manifest says {entry['bytes']} (truncated or corrupt: rebuild the cache)"
                    )
        if sum(s["rows"] for s in self.shards) != self.rows or self.rows % self.batch_size:
            raise FeatureCacheError(
                f"feature cache {self.path}: shards hold {sum(s['rows'] for s in self.shards)} rows, the "
                f"manifest says {self.rows} in batches of {self.batch_size}"
            )
        self.names = tuple(self.shards[0]["files"])
        self._starts = np.cumsum([0] + [s["rows"] for s in self.shards])
        self._open: dict[tuple[int, str], np.ndarray] = {}

    def _array(self, shard: int, name: str) -> np.ndarray:
        key = (shard, name)
        if key not in self._open:
            entry = self.shards[shard]["files"][name]
            f = self.path / entry["file"]
            # Sizes are checked at open; contents here, once per shard (flipped bits keep the size).
            if "sha256" in entry and file_sha256(f) != entry["sha256"]:
                raise FeatureCacheError(
                    f"feature cache {self.path}: shard file {entry['file']} ({name}) does not match the "
                    "checksum in the manifest (corrupt: rebuild the cache)"
                )
            try:
                a = np.load(f, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as e:
                raise FeatureCacheError(
                    f"feature cache {self.path}: cannot read {entry['file']} ({e}): rebuild the cache"
                ) from None
            if list(a.shape) != entry["shape"]:
                raise FeatureCacheError(
                    f"feature cache {self.path}: {entry['file']} has shape {list(a.shape)}, the manifest says {entry['shape']}"
                )
            if self.dtypes[name] == "bfloat16":
                a = a.view(to_dtype("bfloat16"))
            self._open[key] = a
        return self._open[key]

    def array(self, shard: int, name: str) -> np.ndarray:
        """One shard's array ``name`` (memory-mapped), checked against the manifest."""
        return self._array(shard, name)

    def read_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The arrays of global rows ``rows`` (any order), gathered across shards."""
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1
        out = {}
        for name in self.names:
            parts = [None] * len(rows)
            for s in np.unique(shard_of):
                sel = np.nonzero(shard_of == s)[0]
                block = self._array(int(s), name)[rows[sel] - self._starts[s]]
                for i, j in enumerate(sel):
                    parts[j] = block[i]
            out[name] = np.stack(parts)
        return out


class CachedBatchIterator:
    """This process's rows of every global batch, from a :class:`FeatureCache` (see the module
    docstring for the order). ``get_state`` / ``set_state`` have the shape of
    :meth:`data.shards.ShardedBatchIterator.get_state` (one logical shard), so checkpoints store and
    merge it unchanged; every process holds the same position."""

    def __init__(
        self,
        cache: FeatureCache,
        data_cfg,
        *,
        process_index: int = 0,
        process_count: int = 1,
        cast: dict | None = None,
    ):
        rows = data_cfg.rows_per_process(process_count)
        self.cache, self.lo, self.hi = cache, process_index * rows, (process_index + 1) * rows
        self.num_batches = cache.rows // cache.batch_size
        self.num_epochs, self.seed, self.shuffle = data_cfg.num_epochs, data_cfg.seed, data_cfg.shuffle
        self.cast = cast or {}  # array name -> dtype the step expects
        self.epoch, self.batch = 0, 0
        self._order_epoch, self._order = None, None

    def _rows_of_epoch(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            order = np.arange(self.cache.rows)
            if epoch > 0 and self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.cache.rows)
            self._order_epoch, self._order = epoch, order
        return self._order

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.batch == self.num_batches:
            self.epoch, self.batch = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        B = self.cache.batch_size
        rows = self._rows_of_epoch(self.epoch)[self.batch * B : (self.batch + 1) * B][self.lo : self.hi]
        out = self.cache.read_rows(rows)
        self.batch += 1
        return {k: v.astype(self.cast[k]) if k in self.cast else v for k, v in out.items()}

    def get_state(self) -> dict:
        return {
            "num_shards": 1,
            "shards": {"0": {"feature_cache": {"epoch": self.epoch, "batch": self.batch}}},
        }

    def set_state(self, state: dict) -> None:
        try:
            pos = state["shards"]["0"]["feature_cache"]
            self.epoch, self.batch = int(pos["epoch"]), int(pos["batch"])
        except (KeyError, TypeError) as e:
            raise FeatureCacheError(
                f"the checkpoint's data state is not a feature-cache position ({e}): it was saved by a run "
                "that read the data online; resume it without data.features"
            ) from None

    def close(self) -> None:
        self.cache._open.clear()


def write_cache(
    cfg,
    data_cfg,
    target,
    tokenizer,
    target_dir: Path,
    taps,
    out,
    *,
    mesh,
    dtype: str | None = None,
    rows_per_shard: int = 256,
    overwrite: bool = False,
    quiet: bool = False,
    started: float | None = None,
) -> Path:
    """Run the frozen ``target`` once over one epoch of ``data_cfg``'s packed rows and write the
    cache to ``out`` (a temporary sibling, renamed when complete); returns its path.

    ``dtype``: the stored dtype of features (and hidden states); None keeps the dtype the target
    computes them in (exact). Besides the arrays, the manifest holds the label counts a draft
    vocabulary is chosen from (``training/draft_vocab.py``). With ``data_cfg.features_minutes`` the
    build stops at the first batch past that many minutes, or before the first batch that would not
    fit the disk (``complete_epoch: false``); without it a cache that would not fit is refused
    before a byte is written (:func:`check_disk`)."""
    import time

    import jax
    from flax import nnx
    from tqdm import tqdm

    from dflash_jax.data.pipeline import to_global_batch
    from dflash_jax.data.shards import ShardedBatchIterator, resolve_num_shards
    from dflash_jax.sharding import BATCH_AXES, logical_sharding
    from dflash_jax.training.anchors import count_labels
    from dflash_jax.training.loss import target_argmax
    from dflash_jax.training.step import target_pass

    t0 = time.perf_counter() if started is None else started
    taps = tuple(int(t) for t in taps)
    kind, loss_chunk = cfg.train.loss, cfg.train.loss_chunk
    one_epoch = dataclasses.replace(data_cfg, num_epochs=1, features=None)
    stored_name = dtype or cfg.target.dtype  # None: the target's own outputs, in its dtype
    per_row = row_bytes(
        seq_len=data_cfg.max_length,
        hidden_size=target.config.hidden_size,
        num_taps=len(taps),
        dtype=stored_name,
        loss=kind,
    )
    max_rows = check_disk(
        refuse_existing(out, overwrite), per_row, one_epoch, tokenizer, loss=kind, dtype=stored_name
    )
    identity = run_identity(cfg, data_cfg, target_dir, tokenizer, taps)
    writer = CacheWriter(
        out,
        rows_per_shard=-(-rows_per_shard // data_cfg.batch_size) * data_cfg.batch_size,
        overwrite=overwrite,
    )
    rows = ShardedBatchIterator(one_epoch, tokenizer, num_shards=resolve_num_shards(data_cfg.shards, 1))

    @nnx.jit
    def target_outputs(target, batch):
        features, hidden = target_pass(target, batch, taps)
        # The same argmax the step takes online (training/step.py block_loss), from the exact
        # hidden state even where the cache stores it in a narrower dtype.
        labels = target_argmax(hidden, target.lm_head_weight(), chunk=loss_chunk)
        if kind == "ce":
            return {"features": features, "labels": labels}
        return {"features": features, "labels": labels, "hidden": hidden}

    sharding = logical_sharding(mesh, BATCH_AXES)
    stored = None if dtype is None else to_dtype(dtype)
    computed: dict[str, str] = {}
    counts = np.zeros(target.config.vocab_size, np.int64)
    max_minutes = data_cfg.features_minutes
    t_build = time.perf_counter()
    complete = True
    bar = tqdm(desc=f"features -> {writer.out.name}", unit="row", disable=quiet)
    try:
        with jax.set_mesh(mesh):
            for batch in rows:
                over = max_minutes is not None and time.perf_counter() - t_build > 60 * max_minutes
                if over and writer.rows:  # at least one batch, whatever the budget
                    complete = False
                    log.info(
                        "data.features_minutes=%g: the feature cache stops at %d rows (the run trains on "
                        "them; a faster machine builds more of the epoch)",
                        max_minutes,
                        writer.rows,
                    )
                    break
                if max_rows is not None and writer.rows + len(batch["input_ids"]) > max_rows:
                    complete = False
                    log.info("the feature cache stops at %d rows: the disk holds no more", writer.rows)
                    break
                outputs = jax.device_get(target_outputs(target, to_global_batch(batch, sharding)))
                record = {k: np.asarray(batch[k], np.int32) for k in ROW_ARRAYS}
                counts += count_labels(
                    outputs["labels"], batch["loss_mask"], batch["segment_ids"], counts.shape[0]
                )
                for name, value in outputs.items():
                    value = np.asarray(value)
                    computed[name] = dtype_name(value.dtype)
                    if stored is not None and name != "labels":
                        value = value.astype(stored)
                    record[name] = value
                writer.add(record)
                bar.update(len(batch["input_ids"]))
        return writer.finish(
            {
                "identity": identity,
                "batch_size": data_cfg.batch_size,
                "seq_len": data_cfg.max_length,
                "computed_dtypes": computed,
                "target_dir": str(target_dir),
                "config": cfg.to_dict(),
                "build_seconds": round(time.perf_counter() - t0, 3),
                # False: data.features_minutes ran out first and the rows are a prefix of the epoch
                "complete_epoch": complete,
                # Sparse {id: count} of the labels at trainable positions (training/draft_vocab.py).
                "label_counts": {str(i): int(counts[i]) for i in np.flatnonzero(counts)},
                "vocab_size": int(counts.shape[0]),
            }
        )
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        rows.close()


def label_counts(cache: FeatureCache) -> np.ndarray | None:
    """int64 [V] label counts recorded by the cache's builder (None: a cache built before they were)."""
    sparse, vocab = cache.manifest.get("label_counts"), cache.manifest.get("vocab_size")
    if sparse is None or vocab is None:
        return None
    counts = np.zeros(int(vocab), np.int64)
    for i, c in sparse.items():
        counts[int(i)] = int(c)
    return counts


def auto_cache_dir(cfg, data_cfg, target_dir: Path, tokenizer, taps) -> Path:
    """Where ``data.features: auto`` keeps a run's cache: under the cache root, named by the
    digest of what made its rows (the identity a run checks), so every run with the same target,
    taps, tokenizer, rows and labels shares one."""
    from dflash_jax import assets

    identity = run_identity(cfg, data_cfg, target_dir, tokenizer, taps)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return assets.cache_root() / "features" / digest


def ensure_for_run(cfg, parts, mesh, *, quiet: bool = False) -> Path | None:
    """The feature cache a run trains from (None: online). ``data.features: auto`` builds it once,
    beside the regenerated data, under a digest of what made its rows; later runs reuse it (a
    cache is never replaced: written to a temporary sibling and renamed)."""
    import jax

    features = parts.data.features
    if features != "auto":
        return Path(features) if features else None
    path = auto_cache_dir(
        cfg, parts.data, parts.target_dir, parts.tokenizer, parts.drafter_config.target_layer_ids
    )
    if not (path / MANIFEST).is_file():
        if jax.process_count() > 1:
            raise ConfigError(
                "data.features=auto builds its cache on one process: build it with python -m "
                "dflash_jax.features and pass its directory"
            )
        log.info("building the feature cache %s (once; later runs reuse it)", path)
        with jax.set_mesh(mesh):
            write_cache(
                cfg,
                parts.data,
                parts.target,
                parts.tokenizer,
                parts.target_dir,
                parts.drafter_config.target_layer_ids,
                path,
                mesh=mesh,
                quiet=quiet,
            )
    return path


def open_for_run(
    cfg,
    data_cfg,
    target_dir: Path,
    tokenizer,
    taps,
    *,
    process_index: int = 0,
    process_count: int = 1,
    path: str | Path | None = None,
) -> CachedBatchIterator:
    """The training iterator of a run with ``data.features``: the cache (``path``, default
    ``data.features``), checked against the run (``data_cfg``: the run's effective data config,
    regenerated sources included)."""
    cache = FeatureCache(path or data_cfg.features)
    check_identity(cache.identity, run_identity(cfg, data_cfg, target_dir, tokenizer, taps), str(cache.path))
    # Arrays stored in another dtype (--dtype) reach the step in the dtype the target computed
    # them in, as online, so the step compiles the same.
    computed = cache.manifest.get("computed_dtypes", {})
    cast = {k: to_dtype(v) for k, v in computed.items() if k in cache.dtypes and cache.dtypes[k] != v}
    log.info(
        "training from the feature cache %s (%d rows, %d batches per epoch)",
        *(cache.path, cache.rows, cache.rows // cache.batch_size),
    )
    return CachedBatchIterator(
        cache, data_cfg, process_index=process_index, process_count=process_count, cast=cast
    )
