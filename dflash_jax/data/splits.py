"""Held-out evaluation split, decided on record groups before any shuffling.

Each group (a record key; for ShareGPT all parts ``X_0, X_1, ...`` of one chat) gets a score from
a keyed hash of ``(seed, group)``. The held-out groups are those with the lowest scores: the first
``count`` groups, or every group whose score is below ``fraction``. The choice depends only on
the seed and the group names, never on file order, shuffling or process count, so training and
evaluation agree on it and it is stable when more data is appended.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def group_scores(groups: Sequence[str], seed: int) -> dict[str, float]:
    """Uniform [0, 1) score per distinct group, keyed by seed."""
    out = {}
    key = int(seed).to_bytes(8, "little", signed=True)
    for g in dict.fromkeys(groups):
        h = hashlib.blake2b(g.encode("utf-8"), digest_size=8, key=key).digest()
        out[g] = int.from_bytes(h, "little") / 2.0**64
    return out


def heldout_groups(
    groups: Sequence[str], *, seed: int, fraction: float = 0.0, count: int | None = None
) -> list[str]:
    """Held-out groups, in score order. ``count`` (exact number of groups) wins over ``fraction``."""
    scores = group_scores(groups, seed)
    ranked = sorted(scores, key=lambda g: (scores[g], g))
    if count is not None:
        if count > len(ranked):
            raise ValueError(f"heldout_count={count} but the data has only {len(ranked)} conversations")
        return ranked[:count]
    return [g for g in ranked if scores[g] < fraction]


def split_indices(
    groups: Sequence[str], *, seed: int, fraction: float = 0.0, count: int | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """-> (train record indices in original order, held-out record indices per held-out group)."""
    held = heldout_groups(groups, seed=seed, fraction=fraction, count=count)
    pos = {g: k for k, g in enumerate(held)}
    per_group: list[list[int]] = [[] for _ in held]
    train = []
    for i, g in enumerate(groups):
        k = pos.get(g)
        if k is None:
            train.append(i)
        else:
            per_group[k].append(i)
    return np.asarray(train, dtype=np.int64), [np.asarray(p, dtype=np.int64) for p in per_group]
