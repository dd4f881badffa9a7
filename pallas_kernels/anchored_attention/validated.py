"""The configurations a GPU check validated, read by ``attention_impl: auto``.

``validated.json`` beside this file holds one entry per (device kind, head_dim, G, dtype, window)
that ``scripts/gpu_check.sh`` ran on a GPU with every correctness case passing and measured faster
than ``xla`` (fwd+bwd). ``auto`` picks the entry's ``impl`` (``pallas`` with its ``tiles``, or
``tokamax``) for exactly that configuration and ``xla`` for any other: a kernel that has never run
on a GPU is not chosen by default. The file is written by ``scripts/gpu_check.py --record OUTDIR``
from a check's ``result.json``, keyed by the device kind jax reported where the check ran (``NVIDIA
H200``, ``NVIDIA H100 80GB HBM3``, ...); a kind no check has run on gets ``xla``.

Entry::

    {"device_kind": "NVIDIA H200", "head_dim": 128, "groups": 4, "dtype": "bfloat16",
     "window": false, "impl": "pallas", "tiles": {...TileConfig fields...},
     "speedup_vs_xla": 1.8, "jax": "0.11.2", "date": "2026-12-01"}
"""

from __future__ import annotations

import json
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("validated.json")
KEY_FIELDS = ("device_kind", "head_dim", "groups", "dtype", "window")
IMPLS = ("pallas", "tokamax")


def load(path: Path = TABLE_PATH) -> list[dict]:
    rows = json.loads(path.read_text())["validated"] if path.exists() else []
    for i, row in enumerate(rows):
        missing = [f for f in (*KEY_FIELDS, "impl") if f not in row]
        if missing:
            raise ValueError(f"{path}: entry {i} lacks {missing}")
        if row["impl"] not in IMPLS:
            raise ValueError(f"{path}: entry {i} has impl {row['impl']!r}, expected one of {IMPLS}")
    return rows


def key(device_kind: str, head_dim: int, groups: int, dtype: str, window: bool) -> tuple:
    return (device_kind, int(head_dim), int(groups), str(dtype), bool(window))


def lookup(device_kind, head_dim, groups, dtype, window, table: list[dict] | None = None) -> dict | None:
    """The validated entry for this configuration, or None."""
    want = key(device_kind, head_dim, groups, dtype, window)
    for row in load() if table is None else table:
        if key(*(row[f] for f in KEY_FIELDS)) == want:
            return row
    return None


def write(rows: list[dict], path: Path = TABLE_PATH) -> None:
    """Replace the entries with the same key by ``rows``; keep the others."""
    new = {key(*(r[f] for f in KEY_FIELDS)): r for r in rows}
    kept = [r for r in load(path) if key(*(r[f] for f in KEY_FIELDS)) not in new]
    merged = sorted([*kept, *new.values()], key=lambda r: key(*(r[f] for f in KEY_FIELDS)))
    path.write_text(json.dumps({"validated": merged}, indent=2) + "\n")
