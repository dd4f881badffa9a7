"""The drafter's attention kernel under ``shard_map`` on 8 simulated devices: each device runs the
kernel on its own rows (data x fsdp) and kv-head groups (tensor) and the result equals one
device's; the compiled 8-device train step gathers no q/k/v for it; the sharded call lowers for
CUDA at per-device shapes (api.Partition, docs/mesh.md "The drafter's attention kernel")."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from kernel_test_base import MASKED, assert_close, packed_case

from pallas_kernels.anchored_attention import Partition, context_attention
from pallas_kernels.anchored_attention.api import _usable_axes
from pallas_kernels.anchored_attention.lowering import TRITON_CALL, abstract_gpu_mesh, lower_for_cuda

ROWS, HEADS = ("data", "fsdp"), ("tensor",)
PARTITION = Partition(rows=ROWS, heads=HEADS)


def _values_and_grads(qkv, mask, cot_o, cot_lse, **options):
    def loss(q, k, v):
        o, lse = context_attention(q, k, v, *mask, **options)
        seen = lse > MASKED / 2
        return jnp.sum(o * cot_o) + jnp.sum(jnp.where(seen, lse, 0.0) * cot_lse), (o, lse)

    (_, (o, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*qkv)
    return o, lse, grads


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


@pytest.mark.parametrize(
    "shape,K,backward",
    [
        (
            (2, 2, 2),
            4,
            "pallas",
        ),  # rows over data x fsdp, 2 of the 4 kv heads (and their query heads) per device
        pytest.param((2, 1, 4), 2, "pallas", marks=pytest.mark.slow),  # tensor=4 does not divide 2 kv heads
        pytest.param((2, 2, 2), 4, "xla", marks=pytest.mark.slow),  # the Pallas forward, the XLA backward
    ],
)
def test_sharded_kernel_equals_one_device(shape, K, backward):
    qkv, mask = packed_case(0, B=4, T=24, A=4, S=4, N=2 * K, K=K, H=16)
    rng = np.random.default_rng(1)
    cot_o = jnp.asarray(rng.normal(size=qkv[0].shape).astype(np.float32))
    cot_lse = jnp.asarray(rng.normal(size=qkv[0].shape[:-1]).astype(np.float32))
    # One device: the dense reference (the unsharded kernel equals it: test_anchored_attention.py).
    want = jax.jit(lambda *a: _values_and_grads(*a, impl="reference"))(qkv, mask, cot_o, cot_lse)
    mesh = _mesh(shape)
    # Placed as the drafter's activations are: rows over data x fsdp, heads over tensor (if it divides).
    heads = "tensor" if K % shape[2] == 0 else None
    q_spec, kv_spec = P(ROWS, None, None, heads), P(ROWS, None, heads)
    qkv = [
        jax.device_put(x, NamedSharding(mesh, s))
        for x, s in zip(qkv, (q_spec, kv_spec, kv_spec), strict=True)
    ]
    mask = [jax.device_put(m, NamedSharding(mesh, P(ROWS))) for m in mask]
    cot_o, cot_lse = (jax.device_put(c, NamedSharding(mesh, q_spec)) for c in (cot_o, cot_lse))
    with jax.set_mesh(mesh):
        sharded = jax.jit(
            lambda *a: _values_and_grads(
                *a, impl="pallas", interpret=True, backward=backward, partition=PARTITION
            )
        )
        got = sharded(qkv, mask, cot_o, cot_lse)
        hlo = sharded.lower(qkv, mask, cot_o, cot_lse).compile().as_text()
    for name, g, w in zip(
        ("out", "lse", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want), strict=True
    ):
        assert_close(g, w, dtype=jnp.float32, name=name)
    assert "all-gather" not in hlo  # operands arrive split as the kernel takes them


def test_only_axes_that_divide_their_dimension_split_it():
    mesh = _mesh((2, 2, 2))
    assert _usable_axes(mesh, ROWS, 8) == ROWS
    assert _usable_axes(mesh, ROWS, 2) == ()  # a decode batch of 2 rows on 4 row shards: whole
    assert _usable_axes(mesh, HEADS, 3) == ()  # 3 kv heads on tensor=2
    assert _usable_axes(_mesh((8, 1, 1)), ROWS, 8) == ("data",)  # fsdp=1 splits nothing


def test_compiled_train_step_gathers_no_qkv_for_the_kernel():
    """The 8-device train step (data=2, fsdp=2, tensor=2) with the kernel (interpret mode on CPU):
    no all-gather of an activation with the drafter's head_dim as its last axis (q, k, v and their
    gradients, whatever their layout). Without the shard_map the same compile gathers k/v over the
    rows (f32[8,64,4,16] and others)."""
    from dflash_jax.tools import plan
    from dflash_jax.training.run_config import load_run_config

    head_dim = 16
    cfg = load_run_config(
        "qwen3-8b",
        [
            "target.architecture={model_type: qwen3, vocab_size: 512, hidden_size: 64,"
            " intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 8,"
            f" num_key_value_heads: 4, head_dim: {head_dim}}}",
            "drafter.num_layers=1",
            "drafter.mask_token_id=500",
            "drafter.target_layer_ids=null",
            "drafter.block_size=4",
            "drafter.attention_impl=pallas",
            "target.dtype=float32",
            "data.max_length=48",
            "data.batch_size=8",
            "train.max_anchors=8",
            "train.loss_chunk=32",
        ],
    )
    # From the feature cache's arrays: the step is the drafter's alone (no target forward to compile).
    spec = dataclasses.replace(plan.spec_for_run(cfg), cached_features=True)
    p = plan.plan_layout(spec, plan.parse_layout("data=2,fsdp=2,tensor=2"))
    gathers = [array for kind, array in p.collective_shapes if kind == "all-gather"]
    qkv_like = [a for a in gathers if len(d := _dims(a)) >= 4 and d[-1] == head_dim]
    assert qkv_like == []
    assert gathers  # weights are gathered over fsdp: the listing is not empty by accident


def _dims(array_type: str) -> list[int]:
    return [int(d) for d in re.search(r"\[([\d,]*)\]", array_type).group(1).split(",") if d]


def test_sharded_call_lowers_for_cuda_at_per_device_shapes():
    """8 abstract H100s (data=2, fsdp=2, tensor=2), qwen3 drafter heads (32 query, 8 kv, d=128):
    forward and both backward kernels are Triton calls inside the manual (shard_map) region, on
    8 / 4 = 2 rows and 8 / 2 = 4 kv heads each."""
    mesh = abstract_gpu_mesh(axis_sizes=(2, 2, 2), axis_names=("data", "fsdp", "tensor"))
    B, T, A, S, N, K, H = 8, 2048, 64, 16, 32, 8, 128

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    qkv = [arg((B, A, S, N, H), jnp.bfloat16, P(ROWS, None, None, "tensor"))]
    qkv += [arg((B, T, K, H), jnp.bfloat16, P(ROWS, None, "tensor"))] * 2
    shapes = [(B, T), (B, T), (B, A), (B, A), (B, A, S)]
    mask = [arg(s, jnp.int32, P(ROWS)) for s in shapes]

    def grads(q, k, v, *m):
        def loss(q, k, v):
            o, lse = context_attention(q, k, v, *m, impl="pallas", interpret=False, partition=PARTITION)
            return jnp.sum(o) + jnp.sum(lse)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = lower_for_cuda(grads, *qkv, *mask, mesh=mesh)
    assert text.count(TRITON_CALL) == 3, "forward, dq and dk/dv kernels"
    assert "sdy.manual_computation" in text
    operands = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*?\) .*?: \((.*?)\) ->", text)
    assert len(operands) == 3
    for types in operands:
        assert f"tensor<{B // 4}x{T}x{K // 2}x{H}xbf16>" in types  # this device's k (and v)
        assert f"tensor<{B}x" not in types and f"x{K}x{H}xbf16" not in types  # nobody else's
