"""The two grouped-matmul implementations of the routed experts (target/moe.py): the tiled loop
equals ``ragged_dot`` on random routings and their edge cases (empty groups, every row to one
expert, rows routed to another device's experts, no row here at all), for both expert MLP forms;
expert parallelism with the tiled path equals one device; the switch is validated; the train
step's gradient (w.r.t. the drafter, never the target) traces through the tiled loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.sharding import MeshConfig, make_mesh
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.moe import grouped_experts, moe_block, moe_matmul_impl, moe_param_specs, tile_rows

E, D, F, K = 8, 16, 12, 2


def config(model_type="qwen3_moe", **kw) -> TargetConfig:
    extra = dict(swiglu_limit=7.0) if model_type == "gpt_oss" else dict(norm_topk_prob=True)
    if model_type == "qwen3_5_moe":
        extra.update(shared_expert_intermediate_size=20, layer_types=("full_attention",))
        extra.update(linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=4)
        extra.update(linear_value_head_dim=4, partial_rotary_factor=0.5)
    return TargetConfig(
        model_type=model_type,
        vocab_size=64,
        hidden_size=D,
        intermediate_size=F if model_type == "gpt_oss" else 24,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        moe_layers=(0,),
        **extra,
        **kw,
    )


def params(c: TargetConfig, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: jnp.asarray((0.3 if init == "normal" else 0.5) * rng.normal(size=shape), jnp.float32)
        for n, (shape, _, init) in moe_param_specs(c).items()
    }


def experts_of(p: dict, first: int, n_local: int) -> dict:
    """The slice of the stacked expert weights one device of an expert group holds."""
    names = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
    return {n: p[n][first : first + n_local] for n in names if n in p}


def routing(case: str, M: int, seed=1):
    rng = np.random.default_rng(seed)
    if case == "random":
        idx = np.stack([rng.permutation(E)[:K] for _ in range(M)])
    elif case == "empty_groups":  # experts 1, 4, 5 and 6 are never chosen
        idx = np.stack([rng.choice([0, 2, 3, 7], K, replace=False) for _ in range(M)])
    elif case == "one_expert":  # every first choice on expert 3, second choices on 6
        idx = np.tile([3, 6], (M, 1))
    else:
        raise ValueError(case)
    weights = rng.random((M, K))
    return jnp.asarray(weights / weights.sum(-1, keepdims=True), jnp.float32), jnp.asarray(idx, jnp.int32)


# (routing, first expert here, experts here, tile rows): all 8 experts here, or a slice of them
# with the other pairs another device's; tiles of 1 row, of 3 (groups not multiples of it) and of
# 512 (clamped to the rows per expert).
CASES = [
    ("random", 0, 8, 3),
    ("random", 2, 2, 1),
    ("random", 4, 4, 512),
    ("empty_groups", 0, 8, 512),
    ("empty_groups", 1, 3, 3),  # experts 1..3 here, of which only 2 is ever chosen
    ("one_expert", 0, 8, 3),
    ("one_expert", 2, 2, 512),  # expert 3 here, 6 elsewhere
]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize(("case", "first", "n_local", "tile"), CASES)
def test_tiled_equals_ragged_dot(model_type, case, first, n_local, tile):
    M = 37
    c = config(model_type, moe_tile=tile)
    p = experts_of(params(c), first, n_local)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(M, D)), jnp.float32)
    weights, idx = routing(case, M)
    ragged, tiled = (
        jax.jit(lambda *a, impl=impl: grouped_experts(*a, dataclasses.replace(c, moe_matmul=impl), first))(
            x, weights, idx, p
        )
        for impl in ("ragged_dot", "tiled")
    )
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(ragged), atol=1e-5, rtol=1e-5)
    rel = np.asarray(idx) - first
    here = ((rel >= 0) & (rel < n_local)).any(-1)
    assert np.abs(np.asarray(tiled)[here]).min() > 0  # rows with a pair here got it
    assert not np.asarray(tiled)[~here].any()  # rows with none here stay zero


def test_no_row_routed_here_gives_zeros():
    c = config("gpt_oss", moe_matmul="tiled")  # biases: a padding tile would not be zero
    x = jnp.ones((5, D), jnp.float32)
    weights, idx = routing("one_expert", 5)  # experts 3 and 6, this device holds 4 and 5
    out = grouped_experts(x, weights, idx, experts_of(params(c), 4, 2), c, 4)
    assert out.shape == (5, D) and not np.asarray(out).any()


def test_tile_rows_bounds_the_padding():
    assert tile_rows(524_288, 16, 512) == 512  # real size: the configured tile
    assert tile_rows(64, 8, 512) == 8  # 8 rows per expert
    assert tile_rows(8, 128, 512) == 1  # decoding: fewer rows than experts
    assert tile_rows(100, 3, 16) == 16 and tile_rows(100, 3, 64) == 32  # a power of two <= 33


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "qwen3_5_moe"])
@pytest.mark.parametrize(
    "layout",
    [MeshConfig(data=2, fsdp=2, tensor=2), MeshConfig(data=1, fsdp=4, tensor=2)],
    ids=["d2f2t2", "f4t2"],
)
def test_tiled_expert_parallel_equals_single_device(model_type, layout):
    """The MoE block with the tiled matmul on 8 devices (d2f2t2: 2 experts per device, tokens
    gathered over fsdp, summed over tensor; f4t2: 1 expert per device, 4 rows on 4 fsdp devices)
    == the block on one device (the ragged_dot path) within 1e-5."""
    c = config(model_type, moe_matmul="tiled", moe_tile=4)
    p = params(c)
    y = jnp.asarray(np.random.default_rng(3).normal(size=(4, 24, D)), jnp.float32)
    single, load = moe_block(y, p, dataclasses.replace(c, moe_matmul="ragged_dot"))
    mesh = make_mesh(layout)
    with jax.set_mesh(mesh):
        out, sharded_load = jax.jit(lambda y, p: moe_block(y, p, c))(y, p)
        hlo = jax.jit(lambda y, p: moe_block(y, p, c)).lower(y, p).as_text()
    assert "ragged_dot" not in hlo and "while" in hlo and "all_reduce" in hlo  # tiled, expert-parallel
    np.testing.assert_allclose(np.asarray(out), np.asarray(single), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(sharded_load), np.asarray(load))


@pytest.mark.parametrize(("field", "value"), [("moe_matmul", "dense"), ("moe_tile", 0), ("moe_tile", 2.5)])
def test_bad_switch_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=f"TargetConfig.{field} .*{value!r}"):
        config(**{field: value})


def test_auto_is_tiled_off_tpu_and_the_default():
    assert TargetConfig.__dataclass_fields__["moe_matmul"].default == "auto"
    assert moe_matmul_impl(config()) == ("ragged_dot" if jax.default_backend() == "tpu" else "tiled")
    assert moe_matmul_impl(config(moe_matmul="ragged_dot")) == "ragged_dot"


def test_drafter_gradient_traces_through_the_tiled_target():
    """The train step differentiates w.r.t. the drafter with the frozen target's forward inside
    the traced function: the tiled loop carries no tangent there, so the gradient exists."""
    c = config(moe_matmul="tiled")
    p = params(c)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(10, D)), jnp.float32)
    weights, idx = routing("random", 10)

    def loss(scale):
        feats = jax.lax.stop_gradient(grouped_experts(x, weights, idx, p, c))
        return jnp.sum((scale * feats) ** 2)

    g = jax.jit(jax.grad(loss))(jnp.float32(2.0))
    expected = 4.0 * jnp.sum(
        grouped_experts(x, weights, idx, p, dataclasses.replace(c, moe_matmul="ragged_dot")) ** 2
    )
    np.testing.assert_allclose(float(g), float(expected), rtol=1e-5)
