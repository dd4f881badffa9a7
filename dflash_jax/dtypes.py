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

DTYPE_NAMES: tuple[str, ...] = typing.get_args(DtypeName)
COMPUTE_DTYPE_NAMES: tuple[str, ...] = typing.get_args(ComputeDtype)
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
