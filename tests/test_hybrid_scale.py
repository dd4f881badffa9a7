"""qwen3.6-27b at real size, without weights: its written-out architecture parses to the published
numbers, the run config builds the published drafter, and the hybrid target builds under
``nnx.eval_shape`` with shardings on 8 simulated devices and lowers a sharded forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.sharding import MeshConfig, make_mesh, named_sharding
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.hybrid import HybridTargetModel
from dflash_jax.training.run_config import load_run_config


def qwen36_27b() -> TargetConfig:
    return TargetConfig.from_hf_dict(dict(load_run_config("qwen3.6-27b").target.architecture))


def test_config_and_drafter_as_published():
    c = qwen36_27b()
    assert (c.num_layers, c.hidden_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        64,
        5120,
        248320,
        24,
        4,
        256,
    )
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) + c.layer_types[4:]
    assert len(c.full_attention_layers) == 16 and c.full_attention_layers[-1] == 63
    assert c.rotary_dim == 64 and c.rope.theta == 1e7
    run = load_run_config("qwen3.6-27b")
    d = run.drafter
    cfg = DrafterConfig.for_target(
        c,
        num_layers=d.num_layers,
        mask_token_id=c.vocab_size - 1,
        block_size=d.block_size,
        target_layer_ids=d.target_layer_ids,
        layer_types=d.layer_types,
        sliding_window=d.sliding_window,
    )
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61) and cfg.block_size == 16
    assert cfg.layer_types == ("sliding_attention",) * 4 + ("full_attention",) and cfg.sliding_window == 2048


def test_real_size_builds_sharded_and_lowers():
    c = qwen36_27b()
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    abstract = nnx.eval_shape(lambda: HybridTargetModel(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    n_params = sum(int(jnp.size(v)) for v in jax.tree.leaves(state))
    assert 26e9 < n_params < 28e9, n_params  # ~26.9B text parameters
    shardings = jax.tree.map(
        lambda v: named_sharding(mesh, v.get_metadata().get("logical_axes"), v.shape),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    assert shardings["gdn"]["in_qkv"].spec == PartitionSpec(None, "fsdp", "tensor")  # q|k|v by key head
    assert shardings["gdn"]["conv"].spec == PartitionSpec(None, "tensor", None)
    assert shardings["attn"]["q"].spec == PartitionSpec(None, "fsdp", "tensor", None)
    abstract_state = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        state,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    ids = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

    def forward(st, x):
        out = nnx.merge(graphdef, st)(x, layer_ids=(1, 16, 31, 46, 61), return_logits=False)
        return out.hidden, out.features

    with jax.set_mesh(mesh):
        lowered = jax.jit(forward).lower(abstract_state, ids)
    hidden, feats = lowered.out_info
    assert hidden.shape == (2, 256, 5120) and feats.shape == (2, 256, 5 * 5120)


def test_mesh_experiment_plans_a_hybrid_target(tmp_path, capsys):
    """mesh_experiment on the qwen3.6-27b run config with a tiny hybrid architecture: the planner
    builds the hybrid target (replicated, its bytes equal transformers' Qwen3.5 parameter count in
    bf16), compiles the train step for a sharded layout, and rejects a tensor size that does not
    divide the DeltaNet key heads (its q|k|v channels are split by key head), naming them."""
    import json

    import transformers
    from hybrid_fixtures import TINY_HYBRID
    from target_families import run_mesh_experiment

    from dflash_jax.tools import plan

    arch = {**TINY_HYBRID, "num_attention_heads": 8, "num_key_value_heads": 4, "linear_num_value_heads": 6}
    overrides = [
        "target.architecture=" + json.dumps({"model_type": "qwen3_5_text", **arch}),
        "drafter.num_layers=1", "drafter.mask_token_id=500", "drafter.target_layer_ids=null",
        "drafter.layer_types=null", "drafter.sliding_window=null", "train.loss_chunk=64",
    ]  # fmt: skip
    spec = plan.spec_for_run(load_run_config("qwen3.6-27b", overrides), seq_len=128, batch_rows=8)
    _, t_state = plan.abstract_target(spec, make_mesh(MeshConfig(data=8)))
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**arch))
    replicated = plan.per_device_bytes(t_state)
    assert replicated == 2 * sum(p.numel() for p in hf.parameters())  # bfloat16

    text, rows = run_mesh_experiment(
        "qwen3.6-27b", ["fsdp=4,tensor=2", "tensor=4"], overrides, tmp_path / "mx", capsys
    )
    assert "tensor=4 does not divide linear_num_key_heads (target)=2" in text
    sharded = rows["fsdp=4,tensor=2"]
    assert int(sharded["target_param_bytes"]) < replicated / 4
    assert int(sharded["train_temp_bytes"]) > 0 and float(sharded["flops"]) > 0


def test_tensor_parallel_deltanet_equals_one_device():
    """A tiny hybrid on fsdp=4 x tensor=2 (the q|k|v conv channels split by key head with z, beta,
    decay and out_proj) gives the one-device forward's features, hidden states and logits, on
    packed rows."""
    import numpy as np
    from hybrid_fixtures import TINY_HYBRID

    from dflash_jax.sharding import shard_module

    c = TargetConfig.from_hf_dict({"model_type": "qwen3_5_text", **TINY_HYBRID})
    model = HybridTargetModel(c, rngs=nnx.Rngs(3), chunk_size=16)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, c.vocab_size, (8, 80)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 50 + [2] * 30], 8, axis=0), jnp.int32)
    pos = jnp.asarray(np.repeat([list(range(50)) + list(range(30))], 8, axis=0), jnp.int32)
    taps = (0, 2, 5)
    run = lambda m: jax.jit(lambda m, i, p, s: m(i, p, layer_ids=taps, segment_ids=s))(m, ids, pos, seg)
    ref = run(model)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    with jax.set_mesh(mesh):
        sharded = shard_module(model, mesh)
        assert sharded.gdn.in_qkv[...].sharding.spec == PartitionSpec(None, "fsdp", "tensor")
        got = run(sharded)
    for name in ("features", "hidden", "logits"):
        np.testing.assert_allclose(
            np.asarray(getattr(got, name)), np.asarray(getattr(ref, name)), atol=1e-5, rtol=1e-5, err_msg=name
        )
