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

from pathlib import Path

from pallas_kernels.validated_table import ValidatedTable


def _key(device_kind: str, head_dim: int, groups: int, dtype: str) -> tuple:
    return (device_kind, int(head_dim), int(groups), str(dtype))


TABLE = ValidatedTable(
    Path(__file__).with_name("validated.json"),
    key_fields=("device_kind", "head_dim", "groups", "dtype"),
    normalise=_key,
)
TABLE_PATH, KEY_FIELDS = TABLE.path, TABLE.key_fields
load, key, write = TABLE.load, TABLE.key, TABLE.write


def lookup(*values, table: list[dict] | None = None) -> dict | None:
    """The validated entry for ``values`` (the key fields in order), or None."""
    return TABLE.lookup(*values, table=load() if table is None else table)  # ``load`` as patched
