"""The public entry point: ``context_attention(...) -> (out, lse)`` on raw arrays, dispatched to
one of the implementations.

Implementations (``impl``):

* ``reference``: dense ``[A*S, T]`` scores (reference.py); tests and tiny runs only.
* ``xla``: anchor-chunked XLA (xla.py); memory bounded by one chunk, scans all T.
* ``pallas``: the Pallas kernels (pallas_triton.py); visits only visible context tiles. Native on
  NVIDIA GPUs; elsewhere it runs only in interpret mode (slow: tests and tiny runs).
* ``tokamax``: tokamax's attention op (Mosaic GPU on Hopper) for the forward with its softmax
  residuals, our backward (tokamax_impl.py); needs ``pip install tokamax``.
* ``auto``: on a GPU, the implementation ``validated.json`` names for this configuration (device
  kind, head_dim, G, dtype, window) -- ``pallas`` with the recorded tiles, or ``tokamax`` -- and
  ``xla`` for any configuration no GPU check has validated; ``xla`` off GPU. Each choice is
  logged once, with the reason.

On a mesh (``partition``): XLA's partitioner cannot split a kernel's custom call, so it would
gather every device's q/k/v and run all rows everywhere. ``pallas`` and ``tokamax`` therefore run
under ``jax.shard_map``: rows over ``Partition.rows``' mesh axes, kv-head groups (a kv head with
its G query heads, so GQA stays local) over ``Partition.heads``'; each device calls the kernel on
its own rows and heads. An axis that does not divide its dimension (a decode batch of 1, 8 kv
heads on 16 devices) is left out and that dimension is whole on each of its devices. ``xla`` and
``reference`` are plain XLA, which the partitioner splits by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp

from pallas_kernels.anchored_attention import tokamax_impl, validated
from pallas_kernels.anchored_attention.common import check_shapes
from pallas_kernels.anchored_attention.reference import context_attention_reference
from pallas_kernels.anchored_attention.xla import context_attention_xla

IMPLS = ("auto", "pallas", "tokamax", "xla", "reference")
GPU_BACKENDS = ("gpu", "cuda")
BACKWARDS = ("pallas", "xla")

log = logging.getLogger(__name__)


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


def choose_impl(
    impl: str, *, head_dim=None, groups=None, dtype=None, window=None
) -> tuple[str, dict | None, str]:
    """``(impl, validated entry or None, reason)``; resolves ``auto`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl, None, "asked for"
    backend = jax.default_backend()
    if backend not in GPU_BACKENDS:
        return "xla", None, f"backend {backend!r} is not a GPU"
    if head_dim is None:
        return "xla", None, "no shape given to match against validated.json"
    device_kind = jax.devices()[0].device_kind
    dtype = jnp.dtype(dtype).name
    entry = validated.lookup(device_kind, head_dim, groups, dtype, window is not None)
    config = f"{device_kind}, head_dim={head_dim}, G={groups}, {dtype}, window={window is not None}"
    if entry is None:
        return "xla", None, f"no GPU check has validated a kernel for ({config})"
    if entry["impl"] == "tokamax" and tokamax_impl.available() is not None:
        return "xla", None, f"validated.json names tokamax for ({config}) but {tokamax_impl.available()}"
    speed = entry.get("speedup_vs_xla")
    return entry["impl"], entry, f"validated for ({config}) on jax {entry.get('jax')}, {speed}x xla fwd+bwd"


def resolve_impl(impl: str, **shape) -> str:
    """``choose_impl``'s implementation; logs an ``auto`` choice and its reason once."""
    chosen, _, reason = choose_impl(impl, **shape)
    if impl == "auto":
        _log_once(f"attention_impl=auto: using {chosen!r} ({reason})")
    return chosen


@dataclasses.dataclass(frozen=True)
class Partition:
    """Mesh axes the kernel's operands are split over: ``rows`` (the batch dimension of every
    operand), ``heads`` (kv heads of k, v and the query heads of each kv group). The axes of the
    current mesh (``jax.set_mesh`` / ``use_abstract_mesh``) of size 1, or absent, are ignored."""

    rows: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()


def _usable_axes(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
    """The mesh axes of ``axes`` that split (size > 1, not already manual), if together they
    divide ``size``; else none."""
    manual = set(getattr(mesh, "manual_axes", ()))
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in manual)
    return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def on_mesh(fn, partition: Partition | None, q, k, v, *mask):
    """``fn(q, k, v, *mask) -> (out, lse)`` per device under ``jax.shard_map`` (rows and kv-head
    groups as ``partition`` says, see the module doc); ``fn`` itself outside a mesh or when no axis
    splits anything."""
    mesh = jax.sharding.get_abstract_mesh()
    if partition is None or mesh is None or mesh.empty:
        return fn(q, k, v, *mask)
    rows = _usable_axes(mesh, tuple(partition.rows), q.shape[0])
    heads = _usable_axes(mesh, tuple(a for a in partition.heads if a not in rows), k.shape[2])
    if not rows and not heads:
        return fn(q, k, v, *mask)
    P = jax.sharding.PartitionSpec
    r, h = rows or None, heads or None
    q_spec, kv_spec = P(r, None, None, h, None), P(r, None, h, None)
    mask_specs = tuple(P(r) for _ in mask)
    sharded = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, *mask_specs),
        out_specs=(q_spec, P(r, None, None, h)),
        axis_names=frozenset(rows + heads),  # the other axes stay automatic
        check_vma=False,  # pallas_call has no replication rule; every operand and output is split
    )
    return sharded(q, k, v, *mask)


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
    tokamax_implementation: str | None = None,
    partition: Partition | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of block slots over the context entries they see (mask.py, invariant 3).

    q [B, A, S, N, H]; k, v [B, T, K, H] (N a multiple of K: GQA); mask arrays as in
    ``AnchoredMask``. Returns ``out`` fp32 [B, A, S, N, H] and ``lse`` fp32 [B, A, S, N]; a slot
    that sees no context gets ``out = 0`` and ``lse = common.MASKED``.

    ``chunk``: anchors per chunk of ``xla``. ``interpret``: run ``pallas`` in interpret mode
    (default: on non-GPU backends). ``backward``: ``pallas`` kernels or ``xla`` (a debugging
    switch: the Pallas forward with the chunked XLA backward; with ``tokamax``, whose backward
    is always ours, which one). ``tiles``: ``pallas_triton.TileConfig`` (default: the validated entry's,
    else ``TileConfig.default``). ``tokamax_implementation``: tokamax's ``mosaic`` (default on GPU),
    ``triton`` or ``xla`` (default off GPU: the dense op, for tests). ``partition``: the mesh axes
    of rows and kv heads for ``pallas`` and ``tokamax`` (``Partition``; None: the whole arrays).
    """
    check_shapes(q, k, v, ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    mask = (ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions)
    asked = impl
    impl, entry, reason = choose_impl(
        impl, head_dim=q.shape[-1], groups=q.shape[-2] // k.shape[-2], dtype=q.dtype, window=window
    )
    if asked == "auto":
        _log_once(f"attention_impl=auto: using {impl!r} ({reason})")
    if entry is not None and tiles is None and entry.get("tiles"):
        from pallas_kernels.anchored_attention.pallas_triton import TileConfig

        tiles = TileConfig(**entry["tiles"])
    if impl == "reference":
        return context_attention_reference(q, k, v, *mask, window=window, scale=scale)
    if impl == "xla":
        return context_attention_xla(q, k, v, *mask, window=window, scale=scale, chunk=chunk)
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r}; expected one of {BACKWARDS}")
    from pallas_kernels.anchored_attention import pallas_triton

    if interpret is None:
        interpret = jax.default_backend() not in GPU_BACKENDS
        if interpret:
            _log_once(
                f"attention_impl={impl} on a non-GPU backend: running the Pallas kernels in interpret mode"
            )
    if impl == "tokamax":
        why = tokamax_impl.available()
        if why is not None:
            raise ValueError(f"impl='tokamax': {why}; pip install tokamax, or use 'pallas' / 'xla'")
        implementation = tokamax_implementation or ("mosaic" if not interpret else "xla")
        tokamax = functools.partial(
            tokamax_impl.context_attention_tokamax, window=window, scale=scale,
            implementation=implementation, backward=backward, interpret=interpret, tiles=tiles, chunk=chunk,
        )  # fmt: skip
        return on_mesh(tokamax, partition, q, k, v, *mask)
    pallas = functools.partial(
        pallas_triton.context_attention_pallas, window=window, scale=scale, interpret=interpret, tiles=tiles
    )
    if backward == "pallas":
        return on_mesh(pallas, partition, q, k, v, *mask)
    xla = functools.partial(context_attention_xla, window=window, scale=scale, chunk=chunk)
    return on_mesh(
        lambda q, k, v, *m: _pallas_forward_xla_backward(pallas, xla, q, k, v, m), partition, q, k, v, *mask
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pallas_forward_xla_backward(pallas, xla, q, k, v, mask):
    return pallas(q, k, v, *mask)


def _pallas_forward_saving_inputs(pallas, xla, q, k, v, mask):
    """custom_vjp forward: the Pallas kernel's output; the inputs are the residuals."""
    return pallas(q, k, v, *mask), (q, k, v, mask)


def _backward_through_xla(pallas, xla, res, cot):
    """custom_vjp backward: the XLA path's vjp recomputed from the saved inputs."""
    q, k, v, mask = res
    _, vjp = jax.vjp(lambda q, k, v: xla(q, k, v, *mask), q, k, v)
    return (*vjp(cot), None)


_pallas_forward_xla_backward.defvjp(_pallas_forward_saving_inputs, _backward_through_xla)
