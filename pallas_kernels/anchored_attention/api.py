"""The public entry point: ``context_attention(...) -> (out, lse)`` on raw arrays, dispatched to
one of the implementations.

Implementations (``impl``):

* ``reference``: dense ``[A*S, T]`` scores (reference.py); tests and tiny runs only.
* ``xla``: anchor-chunked XLA (xla.py); memory bounded by one chunk, scans all T.
* ``pallas``: the Pallas kernels (pallas_triton.py); visits only visible context tiles. Native on
  NVIDIA GPUs; elsewhere it runs only in interpret mode (slow: tests and tiny runs).
* ``auto``: ``pallas`` on a GPU backend, ``xla`` elsewhere; the choice is logged once.
"""

from __future__ import annotations

import functools
import logging

import jax

from pallas_kernels.anchored_attention.common import check_shapes
from pallas_kernels.anchored_attention.reference import context_attention_reference
from pallas_kernels.anchored_attention.xla import context_attention_xla

IMPLS = ("auto", "pallas", "xla", "reference")
BACKWARDS = ("pallas", "xla")

log = logging.getLogger(__name__)


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


def resolve_impl(impl: str) -> str:
    """``auto`` -> ``pallas`` where the kernel runs natively (GPU), ``xla`` elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    chosen = "pallas" if backend in ("gpu", "cuda") else "xla"
    _log_once(f"attention_impl=auto: using {chosen!r} on backend {backend!r}")
    return chosen


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ctx_segment_ids: jax.Array,
    ctx_positions: jax.Array,
    anchors: jax.Array,
    anchor_segment_ids: jax.Array,
    slot_positions: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
    impl: str = "auto",
    chunk: int = 16,
    interpret: bool | None = None,
    backward: str = "pallas",
    tiles=None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of block slots over the context entries they see (mask.py, invariant 3).

    q [B, A, S, N, H]; k, v [B, T, K, H] (N a multiple of K: GQA); mask arrays as in
    ``AnchoredMask``. Returns ``out`` fp32 [B, A, S, N, H] and ``lse`` fp32 [B, A, S, N]; a slot
    that sees no context gets ``out = 0`` and ``lse = common.MASKED``.

    ``chunk``: anchors per chunk of ``xla``. ``interpret``: run ``pallas`` in interpret mode
    (default: on non-GPU backends). ``backward``: ``pallas`` kernels or ``xla`` (a debugging
    switch: the Pallas forward with the chunked XLA backward). ``tiles``: ``pallas_triton.Tiles``.
    """
    check_shapes(q, k, v, ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    mask = (ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions)
    impl = resolve_impl(impl)
    if impl == "reference":
        return context_attention_reference(q, k, v, *mask, window=window, scale=scale)
    if impl == "xla":
        return context_attention_xla(q, k, v, *mask, window=window, scale=scale, chunk=chunk)
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r}; expected one of {BACKWARDS}")
    from pallas_kernels.anchored_attention import pallas_triton

    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda")
        if interpret:
            _log_once("attention_impl=pallas on a non-GPU backend: running the kernel in interpret mode")
    pallas = functools.partial(
        pallas_triton.context_attention_pallas, window=window, scale=scale, interpret=interpret, tiles=tiles
    )
    if backward == "pallas":
        return pallas(q, k, v, *mask)
    xla = functools.partial(context_attention_xla, window=window, scale=scale, chunk=chunk)
    return _pallas_forward_xla_backward(pallas, xla, q, k, v, mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pallas_forward_xla_backward(pallas, xla, q, k, v, mask):
    return pallas(q, k, v, *mask)


def _pfxb_fwd(pallas, xla, q, k, v, mask):
    return pallas(q, k, v, *mask), (q, k, v, mask)


def _pfxb_bwd(pallas, xla, res, cot):
    q, k, v, mask = res
    _, vjp = jax.vjp(lambda q, k, v: xla(q, k, v, *mask), q, k, v)
    return (*vjp(cot), None)


_pallas_forward_xla_backward.defvjp(_pfxb_fwd, _pfxb_bwd)
