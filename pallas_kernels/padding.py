"""Padding a sequence axis up to a tile multiple, with the value that makes the padding inert
(a segment id that matches nothing, a position no query sees)."""

from __future__ import annotations

import jax.numpy as jnp


def pad_axis1(x, multiple: int, value):
    """``x`` with axis 1 padded by ``value`` to a multiple of ``multiple`` (``x`` itself if it is one)."""
    pad = (-x.shape[1]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)
