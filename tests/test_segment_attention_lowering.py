"""GPU pre-flight of the target's segment attention kernel on a CPU host: it lowers for CUDA
(Triton) at the target shapes of real runs (Qwen3-8B's 32/8 heads, d=128, bf16, T=4096 and 8192)
and at odd ones, with the default tiles inside one H100/H200 block's budget. Abstract shapes only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.target.attention import attend, self_attention_mask
from pallas_kernels.segment_attention import api as kernel_api
from pallas_kernels.segment_attention import segment_attention
from pallas_kernels.segment_attention.lowering import TRITON_CALL, lower_for_cuda
from pallas_kernels.segment_attention.pallas_triton import TileConfig, estimate


def abstract_args(B, T, N, K, H, dtype=jnp.bfloat16):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    return (
        sds((B, T, N, H), dtype), sds((B, T, K, H), dtype), sds((B, T, K, H), dtype),
        sds((B, T), i32), sds((B, T), i32), sds((B, T), i32),
    )  # fmt: skip


def kernel(q, k, v, q_index, q_segment, kv_segment):
    return segment_attention(q, k, v, q_index, q_segment, kv_segment, interpret=False)


@pytest.mark.parametrize(
    "B,T,N,K,H,dtype",
    [
        (2, 8192, 32, 8, 128, jnp.bfloat16),
        (4, 4096, 32, 8, 128, jnp.bfloat16),
        (1, 777, 12, 4, 64, jnp.float32),  # odd length, G=3
        (1, 1024, 16, 2, 256, jnp.bfloat16),
    ],
)
def test_kernel_lowers_for_cuda(B, T, N, K, H, dtype):
    assert lower_for_cuda(kernel, *abstract_args(B, T, N, K, H, dtype)).count(TRITON_CALL) == 1


def test_target_attention_with_pallas_lowers_to_the_kernel(monkeypatch):
    """``attend(impl="pallas")`` on packed rows is one Triton call (and A100's sm_80 lowers too)
    where the process runs on a GPU (off GPU the kernel runs in interpret mode)."""
    monkeypatch.setattr(kernel_api.jax, "default_backend", lambda: "gpu")

    def packed(q, k, v, seg):
        return attend(q, k, v, *self_attention_mask(q.shape[0], q.shape[1], seg), 128**-0.5, impl="pallas")

    q, k, v, seg = abstract_args(1, 2048, 32, 8, 128)[:4]
    for kind in ("NVIDIA H100", "NVIDIA A100"):
        assert lower_for_cuda(packed, q, k, v, seg, device_kind=kind).count(TRITON_CALL) == 1


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_default_tiles_fit_the_budget(H, itemsize):
    assert estimate(TileConfig.default(H, itemsize), H, itemsize).problems() == []


def test_oversized_tiles_are_refused_before_lowering():
    with pytest.raises(ValueError, match="do not fit one H100/H200 block"):
        lower_for_cuda(
            lambda *a: segment_attention(
                *a, tiles=TileConfig(block_q=256, block_k=256, num_stages=4), interpret=False
            ),
            *abstract_args(1, 1024, 8, 8, 256),
        )
