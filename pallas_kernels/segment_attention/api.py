"""The public entry point of the target's causal packed-segment attention kernel, and the choice
between it and the caller's XLA path (``dflash_jax/target/attention.py`` holds that path and calls
``choose_impl``).

Implementations (``impl``):

* ``xla``: the caller's tiled XLA attention; any backend, any mask (sinks, sliding windows).
* ``pallas``: the Pallas forward (pallas_triton.py); native on NVIDIA GPUs, elsewhere only in
  interpret mode (slow: tests and tiny runs). No sinks, no sliding window.
* ``auto``: ``pallas`` only where ``validated.json`` holds this configuration (device kind,
  head_dim, G, dtype), i.e. a GPU check ran the kernel there, found it equal to the XLA path and
  faster, and only for what that check measured: self-attention over packed rows (query length =
  key length; a KV-cache decoding step stays on XLA), no sinks or window (on a mesh the caller runs
  it on each device's rows and heads, where the check's shapes apply). ``xla`` everywhere else,
  which today is everywhere: no GPU check has validated the kernel yet. Each choice is logged once.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.segment_attention import validated

IMPLS = ("auto", "xla", "pallas")
GPU_BACKENDS = ("gpu", "cuda")

log = logging.getLogger(__name__)


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


def choose_impl(
    impl: str,
    *,
    head_dim: int,
    groups: int,
    dtype,
    query_len: int,
    key_len: int,
    sinks: bool = False,
    window: bool = False,
) -> tuple[str, dict | None, str]:
    """``(impl, validated entry or None, reason)``; resolves ``auto`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown target attention impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl, None, "asked for"
    backend = jax.default_backend()
    if backend not in GPU_BACKENDS:
        return "xla", None, f"backend {backend!r} is not a GPU"
    if sinks or window:
        return "xla", None, "the kernel has no attention sinks or sliding window"
    if query_len != key_len:
        return "xla", None, "a KV-cache step (query length != key length): not what a GPU check measured"
    device_kind = jax.devices()[0].device_kind
    dtype = jnp.dtype(dtype).name
    config = f"{device_kind}, head_dim={head_dim}, G={groups}, {dtype}"
    entry = validated.lookup(device_kind, head_dim, groups, dtype)
    if entry is None:
        return "xla", None, f"no GPU check has validated the segment attention kernel for ({config})"
    speed = entry.get("speedup_vs_xla")
    return "pallas", entry, f"validated for ({config}) on jax {entry.get('jax')}, {speed}x xla forward"


def resolve_impl(impl: str, **shape) -> tuple[str, dict | None]:
    """``choose_impl``'s implementation and entry; logs an ``auto`` choice and its reason once."""
    chosen, entry, reason = choose_impl(impl, **shape)
    if impl == "auto":
        _log_once(f"target attention_impl=auto: using {chosen!r} ({reason})")
    return chosen, entry


def segment_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_index: jax.Array,
    q_segment: jax.Array,
    kv_segment: jax.Array,
    *,
    scale: float | None = None,
    tiles=None,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal packed-segment attention, the Pallas forward.

    q [B,T,N,H], k/v [B,S,K,H] (N a multiple of K: GQA, head n reads kv head n // G as HF's
    repeat_kv lays them out); q_index [B,T] (each query's causal bound: the last key slot it may
    see), q_segment [B,T], kv_segment [B,S]: query t sees key s iff ``s <= q_index[t]`` and
    ``kv_segment[s] == q_segment[t]``. Returns [B,T,N,H] in q's dtype (fp32 softmax statistics and
    accumulation); a query that sees nothing gets zeros.

    ``tiles``: ``pallas_triton.TileConfig`` (default ``TileConfig.default``). ``interpret``: run in
    interpret mode (default: on non-GPU backends). Forward only, as the target's XLA path (its
    loops have dynamic bounds): the target is frozen and nothing differentiates through it.
    """
    _check_shapes(q, k, v, q_index, q_segment, kv_segment)
    from pallas_kernels.segment_attention import pallas_triton

    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if interpret is None:
        interpret = jax.default_backend() not in GPU_BACKENDS
    return pallas_triton.segment_attention_pallas(
        q, k, v, q_index, q_segment, kv_segment, scale=scale, tiles=tiles, interpret=interpret
    )


def _check_shapes(q, k, v, q_index, q_segment, kv_segment):
    """Raise a ValueError naming the argument whose shape does not fit ``q [B, T, N, H]``."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [B, T, N, H] and [B, S, K, H], got {q.shape} and {k.shape}")
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"query heads {N} not a multiple of kv heads {K}")
    for name, x, want in (
        ("k", k, (B, S, K, H)),
        ("v", v, (B, S, K, H)),
        ("q_index", q_index, (B, T)),
        ("q_segment", q_segment, (B, T)),
        ("kv_segment", kv_segment, (B, S)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want}")
