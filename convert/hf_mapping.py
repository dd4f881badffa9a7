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
  experts:       HF fused experts ``[E, out, in]`` (Qwen3-MoE ``gate_up_proj``); ours ``[E, in, out]``.
  experts_io:    HF fused experts ``[E, in, out]`` (gpt-oss); ours the same.
  expert_vector: HF per-expert biases ``[E, out]``; ours the same.

MoE extras: ``experts=E`` stacks E per-expert HF tensors (``{e}`` in the name) on a leading expert
axis of ours; ``part=(j, n)`` takes part j of n of the HF tensor's output axis (contiguous, or
every n-th column from j when ``interleaved``), so several of ours share one fused HF tensor;
``quant="mxfp4"`` reads the tensor as ``<name>_blocks`` + ``<name>_scales`` and dequantises it
(``convert.mxfp4``) before the layout is applied.

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

KINDS = ("linear", "vector", "copy", "conv", "experts", "experts_io", "expert_vector")
_OUT_AXIS = {"linear": 0, "experts": 1, "experts_io": 2, "expert_vector": 1}  # HF output axis


@dataclass(frozen=True)
class KeyRule:
    ours: str  # dotted path of our parameter, e.g. "layers.q" or "layers.{i}.mlp.up_proj"
    hf: str  # HF tensor name; "{i}" is the layer index
    kind: str = "copy"  # "linear" | "vector" | "copy" | "conv"
    in_dims: int = 1  # linear only: how many leading dims of ours are the input side
    layers: tuple[int, ...] | None = None  # HF layer index of each row (None: 0..num_layers-1)
    # Our order of the HF tensor's first (output) axis: ours[j] = hf[rows[j]] (None: the same).
    rows: tuple[int, ...] | None = None
    experts: int = 0  # > 0: "{e}" in hf; our per-layer array stacks the E experts' tensors
    part: tuple[int, int] | None = None  # (j, n): part j of n along the HF output axis
    interleaved: bool = False  # part j = HF output columns j, j+n, j+2n, ...
    quant: str | None = None  # "mxfp4": stored as <hf>_blocks + <hf>_scales

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"KeyRule {self.ours!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.part is not None and self.kind not in _OUT_AXIS:
            raise ValueError(f"KeyRule {self.ours!r}: part needs an output axis, kind {self.kind!r} has none")
        if self.quant not in (None, "mxfp4") or (self.quant and self.kind != "experts_io"):
            raise ValueError(f"KeyRule {self.ours!r}: quant {self.quant!r} (only mxfp4 on experts_io)")

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
            yield rule, rule.ours.format(i=i), layer_name(rule, i), row if rule.stacked else None


def _part_shape(rule: KeyRule, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of the part of the tensor one (unstacked) parameter of ours covers."""
    if rule.kind in ("copy", "experts_io", "expert_vector"):
        return tuple(our_shape)
    if rule.kind == "conv":
        return (our_shape[0], 1, our_shape[1])
    if rule.kind == "vector":
        return (math.prod(our_shape),)
    if rule.kind == "experts":
        return (our_shape[0], our_shape[2], our_shape[1])
    ins, outs = our_shape[: rule.in_dims], our_shape[rule.in_dims :]
    return (math.prod(outs), math.prod(ins))


def layer_name(rule: KeyRule, i: int) -> str:
    """The HF name of layer i (an ``{e}`` expert index, if any, left in place)."""
    return rule.hf.replace("{i}", str(i))


def hf_shape(rule: KeyRule, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape for one (unstacked) parameter of ours (one expert's, for ``experts``
    rules; the whole fused tensor, for ``part`` rules; the dequantised one, for ``quant``)."""
    if rule.experts:
        our_shape = our_shape[1:]
    shape = list(_part_shape(rule, our_shape))
    if rule.part is not None:
        shape[_OUT_AXIS[rule.kind]] *= rule.part[1]
    return tuple(shape)


def source_shapes(rule: KeyRule, hf_name: str, our_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors (name -> shape) one (unstacked) parameter of ours is read from."""
    shape = hf_shape(rule, our_shape)
    if rule.experts:
        return {hf_name.replace("{e}", str(e)): shape for e in range(rule.experts)}
    if rule.quant == "mxfp4":
        from convert.mxfp4 import packed_shapes

        blocks, scales = packed_shapes(shape)
        return {hf_name + "_blocks": blocks, hf_name + "_scales": scales}
    return {hf_name: shape}


def _take_part(rule: KeyRule, hf_array: np.ndarray) -> np.ndarray:
    if rule.part is None:
        return hf_array
    j, n = rule.part
    axis = _OUT_AXIS[rule.kind]
    size = hf_array.shape[axis] // n
    index = np.arange(j, hf_array.shape[axis], n) if rule.interleaved else np.arange(j * size, (j + 1) * size)
    return np.take(hf_array, index, axis=axis)


def to_ours(rule: KeyRule, hf_array: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
    hf_array = _take_part(rule, hf_array)
    if rule.rows is not None:
        hf_array = hf_array[np.asarray(rule.rows)]
    if rule.kind == "linear":
        return np.ascontiguousarray(hf_array.T).reshape(our_shape)
    if rule.kind == "experts":
        return np.ascontiguousarray(hf_array.transpose(0, 2, 1)).reshape(our_shape)
    return hf_array.reshape(our_shape)


def read_ours(rule: KeyRule, get, hf_name: str, our_shape: tuple[int, ...]) -> np.ndarray:
    """One (unstacked) parameter of ours from the checkpoint; ``get(name)`` reads a tensor."""
    if rule.experts:
        one = tuple(our_shape[1:])
        return np.stack(
            [to_ours(rule, get(hf_name.replace("{e}", str(e))), one) for e in range(rule.experts)]
        )
    if rule.quant == "mxfp4":
        from convert.mxfp4 import dequantize

        return to_ours(rule, dequantize(get(hf_name + "_blocks"), get(hf_name + "_scales")), our_shape)
    return to_ours(rule, get(hf_name), our_shape)


def to_hf(rule: KeyRule, ours: np.ndarray) -> np.ndarray:
    """Ours -> the HF tensor (for a ``part`` rule: only its part, see ``merge_part``)."""
    if rule.experts:
        raise ValueError(f"KeyRule {rule.ours!r}: per-expert tensors are written with to_hf_experts")
    shape = _part_shape(rule, ours.shape)
    if rule.kind == "linear":
        out = np.ascontiguousarray(ours.reshape(shape[::-1]).T)
    elif rule.kind == "experts":
        out = np.ascontiguousarray(ours.transpose(0, 2, 1))
    else:
        out = ours.reshape(shape)
    if rule.rows is not None:
        hf = np.empty_like(out)
        hf[np.asarray(rule.rows)] = out
        out = hf
    return out


def to_hf_experts(rule: KeyRule, hf_name: str, ours: np.ndarray) -> dict[str, np.ndarray]:
    """An ``experts=E`` rule's per-layer array of ours -> its E per-expert HF tensors."""
    plain = KeyRule(rule.ours, rule.hf, rule.kind, rule.in_dims)
    return {hf_name.replace("{e}", str(e)): to_hf(plain, ours[e]) for e in range(rule.experts)}


def merge_part(rule: KeyRule, full: np.ndarray | None, part: np.ndarray) -> np.ndarray:
    """Write ``part`` (to_hf of a ``part`` rule) into the fused HF tensor ``full`` (None: new)."""
    if rule.part is None:
        return part
    j, n = rule.part
    axis = _OUT_AXIS[rule.kind]
    if full is None:
        shape = list(part.shape)
        shape[axis] *= n
        full = np.zeros(shape, part.dtype)
    size = part.shape[axis]
    index = np.arange(j, size * n, n) if rule.interleaved else np.arange(j * size, (j + 1) * size)
    sl = [slice(None)] * full.ndim
    sl[axis] = index
    full[tuple(sl)] = part
    return full


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
