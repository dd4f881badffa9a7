"""The one HF <-> dflash-jax weight-mapping mechanism, shared by targets and drafters.

A ``KeyRule`` ties one of our parameters (a dotted path in ``nnx.to_pure_dict`` form) to an HF
tensor name; ``{i}`` in either is the layer index. When only the HF name has ``{i}`` our parameter
is *stacked*: one array with a leading layer dimension (the target's scanned layers). The layout
``kind`` defines both directions:

  linear: HF stores ``[out, in]``; we store ``[*in_dims, *out_dims]`` (named einsum layout).
          ours = hf.T.reshape(our_shape);  hf = ours.reshape(hf_shape[::-1]).T
  vector: flattened in HF (norm weights, biases: ours may split heads, e.g. [N, H]).
  copy:   the same shape on both sides (embeddings).
  conv:   HF depthwise Conv1d weight ``[C, 1, W]``; ours ``[C, W]``.

A stacked rule may list ``layers``: the HF layer index of each row of our array (Qwen3.5 hybrids
stack their full- and linear-attention layers separately); default every layer in order.

``check_tensors`` is the strict accounting both loaders run before reading any tensor: every
expected name present with its shape, nothing unexpected, each problem named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

KINDS = ("linear", "vector", "copy", "conv")


@dataclass(frozen=True)
class KeyRule:
    ours: str  # dotted path of our parameter, e.g. "layers.q" or "layers.{i}.mlp.up_proj"
    hf: str  # HF tensor name; "{i}" is the layer index
    kind: str = "copy"  # "linear" | "vector" | "copy" | "conv"
    in_dims: int = 1  # linear only: how many leading dims of ours are the input side
    layers: tuple[int, ...] | None = None  # HF layer index of each row (None: 0..num_layers-1)
    # Our order of the HF tensor's first (output) axis: ours[j] = hf[rows[j]] (None: the same).
    rows: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"KeyRule {self.ours!r}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def stacked(self) -> bool:
        """One array of ours holds every layer's HF tensor (leading layer dimension)."""
        return "{i}" in self.hf and "{i}" not in self.ours

    def layer_indices(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else tuple(self.layers)


def entries(rules: Iterable[KeyRule], num_layers: int) -> Iterator[tuple[KeyRule, str, str, int | None]]:
    """-> (rule, our path, HF name, layer index into our stacked array or None), per HF tensor."""
    for rule in rules:
        if "{i}" not in rule.hf:
            yield rule, rule.ours, rule.hf, None
            continue
        for row, i in enumerate(rule.layer_indices(num_layers)):
            yield rule, rule.ours.format(i=i), rule.hf.format(i=i), row if rule.stacked else None


def hf_shape(rule: KeyRule, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape for one (unstacked) parameter of ours."""
    if rule.kind == "copy":
        return tuple(our_shape)
    if rule.kind == "conv":
        return (our_shape[0], 1, our_shape[1])
    if rule.kind == "vector":
        return (math.prod(our_shape),)
    ins, outs = our_shape[: rule.in_dims], our_shape[rule.in_dims :]
    return (math.prod(outs), math.prod(ins))


def to_ours(rule: KeyRule, hf_array: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
    if rule.rows is not None:
        hf_array = hf_array[np.asarray(rule.rows)]
    if rule.kind == "linear":
        return np.ascontiguousarray(hf_array.T).reshape(our_shape)
    return hf_array.reshape(our_shape)


def to_hf(rule: KeyRule, ours: np.ndarray) -> np.ndarray:
    shape = hf_shape(rule, ours.shape)
    if rule.kind == "linear":
        out = np.ascontiguousarray(ours.reshape(shape[::-1]).T)
    else:
        out = ours.reshape(shape)
    if rule.rows is not None:
        hf = np.empty_like(out)
        hf[np.asarray(rule.rows)] = out
        out = hf
    return out


def _names(keys, limit: int = 20) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (" ..." if len(keys) > limit else "")


def check_tensors(
    what: str,
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[int, ...]],
    ignorable: Iterable[str] = (),
) -> None:
    """Raise one ValueError naming every missing, unexpected or mis-shaped tensor of ``what``."""
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected) - set(ignorable)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    for key, want in expected.items():
        if key in found and tuple(found[key]) != tuple(want):
            problems.append(f"tensor {key!r} has shape {tuple(found[key])}, expected {tuple(want)}")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
