"""MXFP4 (OCP microscaling FP4) expert weights, as gpt-oss checkpoints store them, dequantised at load.

A packed tensor is two arrays: ``<name>_blocks`` uint8 [..., G, 16] (32 FP4 E2M1 values per block,
two per byte, the low nibble first) and ``<name>_scales`` uint8 [..., G] (one power-of-two scale
per block, biased by 127). Value = FP4[nibble] * 2 ** (scale - 127); the 32 values of the G blocks
of a row are concatenated, and the last two axes swapped so the result is the [E, in, out] layout
gpt-oss computes with (transformers' ``convert_moe_packed_tensors`` does the same). Every FP4 value
times a power of two is exact in float32 and in bfloat16 (same exponent range), so the result is
the same bits whichever of the two it is computed in.
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
BLOCK = 32  # values per scale
BLOCK_BYTES = BLOCK // 2


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (blocks, scales) shapes of a dequantised [E, in, out] tensor."""
    *lead, n_in, n_out = shape
    if n_in % BLOCK:
        raise ValueError(
            f"mxfp4: the input dim {n_in} of a {tuple(shape)} tensor is not a multiple of {BLOCK}"
        )
    groups = n_in // BLOCK
    return (*lead, n_out, groups, BLOCK_BYTES), (*lead, n_out, groups)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., R, G, 16], scales uint8 [..., R, G] -> float32 [..., G * 32, R]."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"mxfp4: blocks {blocks.shape} do not match scales {scales.shape} (x {BLOCK_BYTES} bytes)"
        )
    values = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    with np.errstate(over="ignore"):  # scale 255: 2**128 -> inf, as in torch
        out = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)  # exact, as torch.ldexp
    *lead, rows, groups, _ = values.shape
    return np.ascontiguousarray(np.swapaxes(out.reshape(*lead, rows, groups * BLOCK), -1, -2))
