"""GPU pre-flight on a CPU host: the Pallas kernels lower for CUDA (Triton) at the shapes of real
runs with the default tiles, forward and backward, so that an unsupported op or an oversized tile
fails here and not on a GPU. Abstract shapes only: nothing big is allocated.

Triton compiles the lowered IR to PTX only on a GPU, so shared memory is checked by the kernel's own
estimate (``check_tiles``), which this file also exercises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.anchored_attention import context_attention
from pallas_kernels.anchored_attention.pallas_triton import SHARED_MEMORY_BYTES, Tiles, shared_memory_estimate

TRITON_CALL = "__gpu$xla.gpu.triton"


def abstract_args(B, T, A, S, N, K, H, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    return (
        sds((B, A, S, N, H), dtype),
        sds((B, T, K, H), dtype),
        sds((B, T, K, H), dtype),
        sds((B, T), i32),
        sds((B, T), i32),
        sds((B, A), i32),
        sds((B, A), i32),
        sds((B, A, S), i32),
    )


def lower_for_cuda(f, args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def forward(q, k, v, *mask):
    return context_attention(q, k, v, *mask, impl="pallas", interpret=False)


def grads(q, k, v, *mask):
    def loss(q, k, v):
        o, lse = forward(q, k, v, *mask)
        return jnp.sum(o) + jnp.sum(lse)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize(
    "B,T,A,H",
    [(16, 2048, 512, 128), (16, 8192, 512, 128), (2, 2048, 64, 64), (2, 2048, 64, 256)],
)
def test_forward_and_backward_lower_for_cuda(B, T, A, H):
    args = abstract_args(B, T, A, S=16, N=32, K=8, H=H)
    fwd = lower_for_cuda(forward, args)
    assert fwd.count(TRITON_CALL) == 1, "the forward is one Triton kernel"
    bwd = lower_for_cuda(grads, args)
    assert bwd.count(TRITON_CALL) == 3, "forward, dq and dk/dv kernels"


@pytest.mark.parametrize("H", [64, 128, 256])
def test_default_tiles_fit_shared_memory(H):
    for kernel, used in shared_memory_estimate(Tiles.default(H), H, 2).items():
        assert used <= SHARED_MEMORY_BYTES, (kernel, used)


def test_oversized_tiles_are_refused_before_triton():
    args = abstract_args(1, 512, 8, S=16, N=4, K=2, H=256)
    big = Tiles(block_q=256, block_k=256, num_stages=3)
    with pytest.raises(ValueError, match="KiB of shared memory"):
        jax.eval_shape(lambda *a: context_attention(*a, impl="pallas", interpret=False, tiles=big), *args)
