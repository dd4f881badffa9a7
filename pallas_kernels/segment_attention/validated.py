"""The configurations a GPU check validated for the target's segment attention kernel, read by
``target.attention_impl: auto``.

``validated.json`` beside this file holds one entry per (device kind, head_dim, G, dtype) for which
``scripts/gpu_check.sh``'s ``target`` stage ran the kernel on a GPU, found its values equal to the
XLA path's on packed rows at every length it tried, and measured it faster. ``auto`` picks the
kernel (with the entry's ``tiles``) for exactly that configuration and the XLA path for any other.
It is written by ``scripts/gpu_check.py --record OUTDIR``, keyed by the device kind jax reported
where the check ran. No GPU check has run the kernel yet: the table is empty.

Entry::

    {"device_kind": "NVIDIA H200", "head_dim": 128, "groups": 4, "dtype": "bfloat16",
     "tiles": {...TileConfig fields...}, "speedup_vs_xla": 1.9, "jax": "0.11.2", "date": "..."}
"""

from __future__ import annotations

import json
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("validated.json")
KEY_FIELDS = ("device_kind", "head_dim", "groups", "dtype")


def load(path: Path = TABLE_PATH) -> list[dict]:
    rows = json.loads(path.read_text())["validated"] if path.exists() else []
    for i, row in enumerate(rows):
        missing = [f for f in KEY_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: entry {i} lacks {missing}")
    return rows


def key(device_kind: str, head_dim: int, groups: int, dtype: str) -> tuple:
    return (device_kind, int(head_dim), int(groups), str(dtype))


def lookup(device_kind, head_dim, groups, dtype, table: list[dict] | None = None) -> dict | None:
    """The validated entry for this configuration, or None."""
    want = key(device_kind, head_dim, groups, dtype)
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
