"""Held-out splits (test and validation), decided on record groups before any shuffling.

A group is one conversation: a record key ``"<file name>:<id>"`` (a record without an ``id`` is
named by its file and line), for ShareGPT all parts ``X_0, X_1, ...`` of one chat. Each group gets a
score from a keyed hash of ``(seed, group)``, uniform in [0, 1) and independent of file order,
shuffling and process count, so training and evaluation agree on it. Two held-out splits come out,
disjoint and never trained on:

- **test**: what only a run's final report measures (tau after training, the README's figure);
- **validation**: what everything that chooses measures (the tau curve during training, recipe
  A/Bs), so that a choice made on it does not bias the test figure.

Fraction mode: test holds the groups scoring below ``test_fraction``, validation those from there
to ``test_fraction + validation_fraction``. A group's side depends on its own name and the seed
only, so appending data never moves an existing conversation between sides.

Count mode: test holds the ``test_count`` lowest-scoring groups, validation the next
``validation_count``: exact sizes, at a price when data is added (more records, a higher
``data.max_records``): a new group that scores lower takes a place, so an existing one moves down
the ranking (test -> validation -> training), never up. Comparing runs over different data is
honest in fraction mode, or on the smaller data's prompts only where every run held them out.

Duplicates: a held-out group whose normalised first user turn (casefolded, whitespace collapsed)
equals one of a training record, of a test group (for validation) or of an earlier group of its own
split is removed: neither trained on nor evaluated, and counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from collections.abc import Sequence
from typing import Literal

import numpy as np

# Part of the regeneration cache's key: what the split puts where changed with it (2: duplicates
# removed, validation apart from test).
VERSION = 2
NO_PROMPT = 0  # prompt key of a record without a user turn
HeldoutSplit = Literal["validation", "test"]
HELDOUT_SPLITS: tuple[str, ...] = typing.get_args(HeldoutSplit)


def normalized_prompt(text: str) -> str:
    """The form duplicates are compared in: casefolded, whitespace runs as one space, stripped."""
    return " ".join(text.casefold().split())


def prompt_key(text: str | None) -> int:
    """64-bit digest of :func:`normalized_prompt` (:data:`NO_PROMPT` for None), never 0 otherwise."""
    if text is None:
        return NO_PROMPT
    h = hashlib.blake2b(normalized_prompt(text).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "little") or 1


def group_scores(groups: Sequence[str], seed: int) -> dict[str, float]:
    """Uniform [0, 1) score per distinct group, keyed by seed."""
    out = {}
    key = int(seed).to_bytes(8, "little", signed=True)
    for g in dict.fromkeys(groups):
        h = hashlib.blake2b(g.encode("utf-8"), digest_size=8, key=key).digest()
        out[g] = int.from_bytes(h, "little") / 2.0**64
    return out


def heldout_groups(
    groups: Sequence[str],
    *,
    seed: int,
    test_fraction: float = 0.0,
    test_count: int | None = None,
    validation_fraction: float = 0.0,
    validation_count: int | None = None,
) -> tuple[list[str], list[str]]:
    """(test groups, validation groups), each in score order, before duplicates are removed.
    Counts (exact numbers of groups) and fractions are two modes; a count set wins."""
    scores = group_scores(groups, seed)
    ranked = sorted(scores, key=lambda g: (scores[g], g))
    if test_count is not None or validation_count is not None:
        n_test, n_val = test_count or 0, validation_count or 0
        if n_test + n_val > len(ranked):
            raise ValueError(
                f"heldout_count={n_test} + validation_count={n_val} conversations held out, but the "
                f"data has only {len(ranked)} conversations"
            )
        return ranked[:n_test], ranked[n_test : n_test + n_val]
    top = test_fraction + validation_fraction
    test = [g for g in ranked if scores[g] < test_fraction]
    return test, [g for g in ranked if test_fraction <= scores[g] < top]


@dataclasses.dataclass(frozen=True)
class Split:
    """Record indices: ``train`` in the records' order; ``test`` and ``validation`` one array per
    kept group, in score order; ``removed``: held-out groups dropped as duplicates, per split."""

    train: np.ndarray
    test: list[np.ndarray]
    validation: list[np.ndarray]
    removed: dict[str, int]


def split_indices(
    groups: Sequence[str],
    *,
    seed: int,
    test_fraction: float = 0.0,
    test_count: int | None = None,
    validation_fraction: float = 0.0,
    validation_count: int | None = None,
    prompt_keys: Sequence[int] | None = None,
) -> Split:
    """Split record indices by group (see the module docstring); ``prompt_keys`` (per record,
    :func:`prompt_key` of its first user turn) removes duplicated held-out groups."""
    test, val = heldout_groups(
        groups,
        seed=seed,
        test_fraction=test_fraction,
        test_count=test_count,
        validation_fraction=validation_fraction,
        validation_count=validation_count,
    )
    side = {g: ("test", k) for k, g in enumerate(test)} | {g: ("validation", k) for k, g in enumerate(val)}
    members: dict[str, list[list[int]]] = {"test": [[] for _ in test], "validation": [[] for _ in val]}
    train = []
    for i, g in enumerate(groups):
        where = side.get(g)
        if where is None:
            train.append(i)
        else:
            members[where[0]][where[1]].append(i)
    keys = [NO_PROMPT] * len(groups) if prompt_keys is None else [int(k) for k in prompt_keys]
    seen = {keys[i] for i in train}  # test is kept before validation: a shared prompt leaves validation
    kept: dict[str, list[np.ndarray]] = {}
    removed = {}
    for name in ("test", "validation"):
        kept[name], removed[name] = [], 0
        for idx in members[name]:
            mine = {keys[i] for i in idx} - {NO_PROMPT}
            if mine & seen:
                removed[name] += 1
                continue
            seen |= mine
            kept[name].append(np.asarray(idx, dtype=np.int64))
    return Split(
        train=np.asarray(train, dtype=np.int64),
        test=kept["test"],
        validation=kept["validation"],
        removed=removed,
    )
