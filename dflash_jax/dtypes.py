"""The one table of dtype names that configs and CLIs accept, and the dtypes they stand for."""

from __future__ import annotations

import typing
from typing import Literal

import ml_dtypes
import numpy as np

# Storage dtypes of weights (targets, drafter params, exports).
DtypeName = Literal["float32", "bfloat16", "float16"]
# Matmul dtypes of the training step (fp32 accumulation either way).
ComputeDtype = Literal["float32", "bfloat16"]
# The drafter's activations in training (hidden states, q/k/v, MLP); ``auto``: see ``activation_dtype``.
ActivationDtype = Literal["auto", "float32", "bfloat16"]

DTYPE_NAMES: tuple[str, ...] = typing.get_args(DtypeName)
COMPUTE_DTYPE_NAMES: tuple[str, ...] = typing.get_args(ComputeDtype)
GPU_BACKENDS = ("gpu", "cuda")
_TABLE = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def to_dtype(dtype) -> np.dtype:
    """A dtype name of :data:`DtypeName` (or a dtype) -> ``np.dtype`` (usable by jax and numpy)."""
    if isinstance(dtype, str):
        if dtype not in _TABLE:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(DTYPE_NAMES)}")
        return _TABLE[dtype]
    return np.dtype(dtype)


def activation_dtype(activations: str, products: str, backend: str | None = None) -> str:
    """The dtype name of the drafter's activations in a training step (``train.activation_dtype``
    over ``train.compute_dtype``, the products' dtype).

    ``auto`` is bfloat16 where the step runs on a GPU with bfloat16 products (what the validated
    bfloat16 attention kernel and the GPU check's bfloat16 step are), float32 elsewhere: on CPU the
    products alone are bfloat16 (the recipe BENCHMARKS.md measured there), and float32 products
    keep the whole drafter in float32 (the path for checks). ``backend``: default jax's."""
    if activations != "auto":
        return activations
    if products != "bfloat16":
        return "float32"
    if backend is None:
        import jax

        backend = jax.default_backend()
    return "bfloat16" if backend in GPU_BACKENDS else "float32"
