"""GPU pre-flight on a CPU host: the Pallas kernels lower for CUDA (Triton) at the shapes of real
runs with the default tiles, forward and backward, so that an unsupported op or an oversized tile
fails here and not on a GPU. Abstract shapes only: nothing big is allocated. Works on jax 0.10.x
and 0.11.x (``lowering.lower_for_cuda`` names the target GPU).

Triton compiles the lowered IR to PTX only on a GPU, so shared memory and registers are checked by
the kernels' own budget (``budget.py``), which every lowering here runs at its real shape (G, d,
dtype) and which the tests below pin at the shape of the qwen3 drafters (G=4, d=128, bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.anchored_attention import budget, context_attention
from pallas_kernels.anchored_attention.lowering import TRITON_CALL, lower_for_cuda
from pallas_kernels.anchored_attention.pallas_triton import (
    SHARED_MEMORY_BYTES,
    TileConfig,
    shared_memory_estimate,
)


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


def forward(q, k, v, *mask, tiles=None):
    return context_attention(q, k, v, *mask, impl="pallas", interpret=False, tiles=tiles)


def grads(q, k, v, *mask, tiles=None):
    def loss(q, k, v):
        o, lse = forward(q, k, v, *mask, tiles=tiles)
        return jnp.sum(o) + jnp.sum(lse)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize(
    "B,T,A,H,dtype",
    [
        (16, 2048, 512, 128, jnp.bfloat16),
        (16, 8192, 512, 128, jnp.bfloat16),
        (2, 2048, 64, 64, jnp.bfloat16),
        (2, 2048, 64, 256, jnp.bfloat16),
        (2, 2048, 64, 128, jnp.float32),
    ],
)
def test_forward_and_backward_lower_for_cuda(B, T, A, H, dtype):
    args = abstract_args(B, T, A, S=16, N=32, K=8, H=H, dtype=dtype)
    fwd = lower_for_cuda(forward, *args)
    assert fwd.count(TRITON_CALL) == 1, "the forward is one Triton kernel"
    bwd = lower_for_cuda(grads, *args)
    assert bwd.count(TRITON_CALL) == 3, "forward, dq and dk/dv kernels"


def test_lowers_for_an_ampere_target_too():
    args = abstract_args(2, 1024, 32, S=16, N=32, K=8, H=128)
    assert lower_for_cuda(grads, *args, device_kind="NVIDIA A100").count(TRITON_CALL) == 3


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_default_tiles_fit_the_budget(H, itemsize):
    for G in (1, 4, 8):
        assert budget.problems(TileConfig.default(H, itemsize), H, G, itemsize) == {
            k: [] for k in budget.KERNELS
        }
    for kernel, used in shared_memory_estimate(
        TileConfig.default(H, itemsize), H, itemsize, groups=8
    ).items():
        assert used <= SHARED_MEMORY_BYTES, (kernel, used)


# The first dk/dv kernel: the G query heads unrolled in the loop body, 4 warps, 2 stages.
FIRST_DKDV = TileConfig(dkdv_groups="unroll", num_warps_dkdv=4, num_stages_dkdv=2)


def test_first_dkdv_config_is_over_budget_at_g4_d128_bf16():
    """At the qwen3 drafters' shape the unrolled G loop streams 2G = 8 tiles per pipeline stage:
    317,440 bytes of shared memory > 232,448, and ~288 registers per thread at 4 warps."""
    est = budget.estimate(FIRST_DKDV, head_dim=128, groups=4, itemsize=2)["dkdv"]
    # 2 stages x (4 heads x (q, do tiles + lse, delta rows) + 3 mask rows) + K, V tiles + p^T, ds^T
    assert (est.stages, est.streamed_bytes, est.resident_bytes, est.scratch_bytes) == (
        2,
        133_888,
        33_280,
        16_384,
    )
    assert est.shared_bytes == 317_440
    assert est.shared_bytes > SHARED_MEMORY_BYTES == 232_448
    assert est.registers_per_thread > budget.REGISTERS_PER_THREAD
    assert budget.problems(FIRST_DKDV, 128, 4, 2)["forward"] == []  # only dk/dv is over
    args = abstract_args(16, 8192, 512, S=16, N=32, K=8, H=128)
    with pytest.raises(ValueError, match=r"the dkdv kernel needs 317,440 bytes of shared memory"):
        lower_for_cuda(lambda *a: grads(*a, tiles=FIRST_DKDV), *args)
    # the chosen default at the same shape: within budget, and it lowers
    default = budget.estimate(TileConfig.default(128), 128, 4, 2)["dkdv"]
    assert default.shared_bytes <= SHARED_MEMORY_BYTES and default.registers_per_thread <= 255
    assert lower_for_cuda(grads, *args).count(TRITON_CALL) == 3


def test_budget_counts_the_g_heads_only_when_unrolled():
    loop, unroll = TileConfig.default(128), TileConfig.default(128).replace(dkdv_groups="unroll")
    sizes = {g: budget.estimate(unroll, 128, g, 2)["dkdv"].shared_bytes for g in (1, 2, 4)}
    assert sizes[1] < sizes[2] < sizes[4]
    assert len({budget.estimate(loop, 128, g, 2)["dkdv"].shared_bytes for g in (1, 2, 4)}) == 1
    more_stages = loop.replace(num_stages_dkdv=3)
    assert (
        budget.estimate(more_stages, 128, 4, 2)["dkdv"].shared_bytes
        > budget.estimate(loop, 128, 4, 2)["dkdv"].shared_bytes
    )


def test_oversized_tiles_are_refused_before_triton():
    args = abstract_args(1, 512, 8, S=16, N=4, K=2, H=256)
    big = TileConfig(block_q=256, block_k=256, num_stages=3)
    with pytest.raises(ValueError, match="the forward kernel needs .* bytes of shared memory"):
        jax.eval_shape(lambda *a: context_attention(*a, impl="pallas", interpret=False, tiles=big), *args)
