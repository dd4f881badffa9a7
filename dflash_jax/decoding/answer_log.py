"""An append-only chat JSONL that regeneration writes answer by answer, and resumes by record id.

Every record is one line, written and flushed as soon as its answer arrives, so a crash or a kill
loses at most the answer being written: flushed lines are in the operating system's hands even when
the process dies; ``os.fsync`` (at most once per ``FSYNC_EVERY_S`` and on close) bounds what a
machine crash can take. A rerun reads the ids already there and answers only the others. A kill in
the middle of a write leaves a last line without its newline, or one that does not parse: it is
dropped (the file is cut back to the last whole line) and its record answered again. A bad line
anywhere else is not a kill's trace but a damaged file, and is an error naming the line.

While a file is incomplete, ``<file>.settings.json`` beside it holds what decides its answers (the
backend, the model, the decoding and prompt settings): a resume with other settings would mix two
kinds of answer in one file, so it is refused, naming each setting that differs.

When every prompt is answered, :meth:`AnswerLog.finish` rewrites the file in the prompts' order, so a
completed file does not depend on the order in which concurrent answers arrived or on where a run
was interrupted, and removes the settings file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dflash_jax.data.sources import BadDataError, rec_messages, validate_record

log = logging.getLogger(__name__)

FSYNC_EVERY_S = 1.0


def read_answered(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """-> ({record id: record} of the whole lines of ``path``, bytes of a torn last line). The torn
    tail is not removed here (:class:`AnswerLog` cuts it)."""
    path = Path(path)
    done: dict[str, dict] = {}
    lines = path.read_bytes().split(b"\n")
    # split() leaves b"" after a final newline; anything else there was cut mid-write.
    tail = lines.pop()
    offset = 0
    for lineno, line in enumerate(lines, start=1):
        start, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rec_id = str(rec["id"])
        except (ValueError, KeyError, TypeError) as e:
            if lineno == len(lines) and not tail:
                # A whole last line that does not parse: a write cut short (a full disk, a crash
                # after its newline); dropped like a torn tail.
                return done, offset - start
            raise BadDataError(
                f"{path}: line {lineno} is not a regenerated record ({type(e).__name__}: {e}); "
                "a resumed file is only ever cut at its last line: move it away or pass --overwrite"
            ) from None
        if rec_id in done:
            raise BadDataError(f"{path}: line {lineno}: record id {rec_id!r} appears twice")
        done[rec_id] = rec
    return done, len(tail)


def settings_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".settings.json")


def _write_json_atomically(path: Path, value) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_settings(path: Path, settings: Mapping[str, Any], answered: int) -> None:
    """Refuse to resume ``path`` (``answered`` records in it) with other ``settings`` than the ones
    its first answers were made with."""
    stored_at = settings_path(path)
    if not stored_at.is_file():
        if answered:
            log.warning(
                "%s: no %s beside it, so the settings of its %d answers are not known; resuming with "
                "this run's",
                path,
                stored_at.name,
                answered,
            )
        return
    stored = json.loads(stored_at.read_text())
    now = json.loads(json.dumps(dict(settings), sort_keys=True))  # as stored: tuples become lists
    differ = sorted(k for k in stored.keys() | now.keys() if stored.get(k) != now.get(k))
    if differ:
        what = "; ".join(f"{k}: {stored.get(k)!r} then, {now.get(k)!r} now" for k in differ)
        raise BadDataError(
            f"{path}: its {answered} answers were made with other settings ({what}); resume it with "
            "those, or pass --overwrite to start it anew"
        )


class AnswerLog:
    """The regenerated records of one output file. ``resume=False`` starts it empty (replacing
    what is there: the caller has checked ``--overwrite``); ``resume=True`` keeps its whole lines
    (:attr:`done`) and cuts a torn last one. ``settings`` (JSON values): what decides the answers,
    kept beside the file until :meth:`finish` and compared on a resume (:func:`check_settings`)."""

    def __init__(self, path: str | os.PathLike, *, resume: bool, settings: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: dict[str, dict] = {}
        torn = 0
        if resume and self.path.is_file():
            self.done, torn = read_answered(self.path)
            if settings is not None:  # before anything is changed: a refusal leaves the file as it was
                check_settings(self.path, settings, len(self.done))
        if settings is not None:
            _write_json_atomically(settings_path(self.path), dict(settings))
        if torn:
            with open(self.path, "r+b") as f:
                f.truncate(self.path.stat().st_size - torn)
            log.warning("%s: dropped a torn last line (%d bytes); its record is answered again", path, torn)
        if self.done:
            log.info("%s: resuming after %d answered records", path, len(self.done))
        self._file = open(self.path, "a" if resume else "w", encoding="utf-8")  # noqa: SIM115
        self._synced_at = time.monotonic()

    def append(self, rec: Mapping[str, Any]) -> None:
        """Validate ``rec`` (a chat record with an id, as the data pipeline reads them), write it as
        one line and flush it."""
        rec_id = str(rec["id"])
        if rec_id in self.done:
            raise ValueError(f"{self.path}: record id {rec_id!r} written twice")
        norm = validate_record(dict(rec), origin=f"{self.path}: record {rec_id!r}")
        out = {k: v for k, v in rec.items() if k not in ("messages", "conversations", "origin")}
        out["id"] = norm["id"]
        out["messages"] = rec_messages(rec)
        self._file.write(json.dumps(out, ensure_ascii=False) + "\n")
        self._file.flush()
        if time.monotonic() - self._synced_at >= FSYNC_EVERY_S:
            os.fsync(self._file.fileno())
            self._synced_at = time.monotonic()
        self.done[rec_id] = out

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def finish(self, order: Iterable[str]) -> int:
        """Close, then rewrite the file atomically with its records in ``order`` (record ids; ids
        not in the file are skipped: prompts that gave no answer). Returns the records written."""
        self.close()
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        n = 0
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for rec_id in order:
                    if rec_id in self.done:
                        f.write(json.dumps(self.done[rec_id], ensure_ascii=False) + "\n")
                        n += 1
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        settings_path(self.path).unlink(missing_ok=True)  # complete: nothing left to resume
        return n

    def __enter__(self) -> AnswerLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["AnswerLog", "check_settings", "read_answered", "settings_path"]
