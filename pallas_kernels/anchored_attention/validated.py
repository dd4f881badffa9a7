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

from pathlib import Path

from pallas_kernels.validated_table import ValidatedTable

IMPLS = ("pallas", "tokamax")


def _key(device_kind: str, head_dim: int, groups: int, dtype: str, window: bool) -> tuple:
    return (device_kind, int(head_dim), int(groups), str(dtype), bool(window))


def _check(row: dict) -> str | None:
    return None if row["impl"] in IMPLS else f"has impl {row['impl']!r}, expected one of {IMPLS}"


TABLE = ValidatedTable(
    Path(__file__).with_name("validated.json"),
    key_fields=("device_kind", "head_dim", "groups", "dtype", "window"),
    normalise=_key,
    required=("impl",),
    check=_check,
)
TABLE_PATH, KEY_FIELDS = TABLE.path, TABLE.key_fields
load, key, write = TABLE.load, TABLE.key, TABLE.write


def lookup(*values, table: list[dict] | None = None) -> dict | None:
    """The validated entry for ``values`` (the key fields in order), or None."""
    return TABLE.lookup(*values, table=load() if table is None else table)  # ``load`` as patched
