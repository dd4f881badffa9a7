"""A kernel's ``validated.json``: the configurations a GPU check ran the kernel on, found correct
and measured faster than the XLA path, read by ``auto`` and written by ``scripts/gpu_check.py
--record``. Each kernel package names its key fields and how a key's values are normalised."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ValidatedTable:
    path: Path
    key_fields: tuple[str, ...]
    normalise: Callable[..., tuple]  # the key's values -> a comparable tuple (int(head_dim), ...)
    required: tuple[str, ...] = ()  # fields besides the key that every entry must have
    check: Callable[[dict], str | None] = lambda row: None  # what is wrong with an entry, or None

    def key(self, *values) -> tuple:
        return self.normalise(*values)

    def _row_key(self, row: dict) -> tuple:
        return self.key(*(row[f] for f in self.key_fields))

    def load(self, path: Path | None = None) -> list[dict]:
        path = self.path if path is None else path
        rows = json.loads(path.read_text())["validated"] if path.exists() else []
        for i, row in enumerate(rows):
            missing = [f for f in (*self.key_fields, *self.required) if f not in row]
            if missing:
                raise ValueError(f"{path}: entry {i} lacks {missing}")
            problem = self.check(row)
            if problem:
                raise ValueError(f"{path}: entry {i} {problem}")
        return rows

    def lookup(self, *values, table: Sequence[dict] | None = None) -> dict | None:
        """The validated entry for this configuration, or None."""
        want = self.key(*values)
        for row in self.load() if table is None else table:
            if self._row_key(row) == want:
                return row
        return None

    def write(self, rows: Sequence[dict], path: Path | None = None) -> None:
        """Replace the entries with the same key by ``rows``; keep the others."""
        path = self.path if path is None else path
        new = {self._row_key(r): r for r in rows}
        kept = [r for r in self.load(path) if self._row_key(r) not in new]
        merged = sorted([*kept, *new.values()], key=self._row_key)
        path.write_text(json.dumps({"validated": merged}, indent=2) + "\n")
