"""The shipped MoE run configs at real size, without weights: each written-out architecture parses
to the parameter count transformers builds from it (on the meta device), the published drafter
shape comes out of the run config, the expert weights shard whole over fsdp on 8 simulated
devices, and mesh_experiment plans a tiny MoE architecture through the same config, rejecting a
layout whose fsdp x tensor does not divide the experts with both numbers named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from dflash_jax.sharding import MeshConfig, make_mesh, named_sharding
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.hybrid import build_target_model
from dflash_jax.training.run_config import load_run_config

CONFIGS = {
    # name: (model_type, layers, experts, top-k, drafter taps)
    "qwen3-30b-a3b": ("qwen3_moe", 48, 128, 8, (1, 12, 23, 34, 45)),
    "qwen3.6-35b-a3b": ("qwen3_5_moe", 40, 256, 8, (1, 10, 19, 28, 37)),
    "gpt-oss-20b": ("gpt_oss", 24, 32, 4, (1, 6, 11, 16, 21)),
}


def _hf_param_count(arch: dict) -> int:
    import torch
    import transformers

    arch = {k: v for k, v in arch.items() if k != "quantization_config"}
    hf_type = arch["model_type"]
    cls = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
        "gpt_oss": transformers.GptOssConfig,
    }[hf_type]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cls(**arch))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_architecture_and_drafter_as_published(name):
    from dflash_jax.tools import plan

    run = load_run_config(name)
    arch = dict(run.target.architecture)
    c = TargetConfig.from_hf_dict(arch)
    model_type, layers, experts, k, taps = CONFIGS[name]
    assert (c.model_type, c.num_layers, c.num_experts, c.num_experts_per_tok) == (
        model_type,
        layers,
        experts,
        k,
    )
    assert c.moe_layers == tuple(range(layers))
    abstract = nnx.eval_shape(lambda: build_target_model(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    ours = sum(int(jnp.size(v)) for v in jax.tree.leaves(nnx.state(abstract)))
    assert ours == _hf_param_count(arch)
    spec = plan.spec_for_run(run)
    assert spec.drafter_config.target_layer_ids == taps and spec.drafter_config.block_size == 16
    assert plan.check_layout(run.mesh, spec, 8) == (1, 4, 2)  # the planned mesh (docs/mesh.md)
    mesh = make_mesh(MeshConfig(data=1, fsdp=8))
    gate = abstract.moe.gate
    assert named_sharding(mesh, gate.get_metadata()["logical_axes"], gate.shape).spec == PartitionSpec(
        None, "fsdp", None, None
    )


def test_mesh_experiment_plans_a_moe_target(tmp_path, capsys):
    import json

    from moe_fixtures import TINY_QWEN3_MOE
    from target_families import run_mesh_experiment

    arch = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "mlp_only_layers": [], "num_experts": 8}
    overrides = [
        "target.architecture=" + json.dumps(arch), "drafter.num_layers=1", "drafter.mask_token_id=500",
        "drafter.target_layer_ids=null", "train.loss_chunk=64",
    ]  # fmt: skip
    text, rows = run_mesh_experiment(
        "qwen3-30b-a3b", ["fsdp=4,tensor=2", "data=2,fsdp=3"], overrides, tmp_path / "mx", capsys
    )
    assert "mesh axis fsdp*tensor=3 does not divide num_experts (target)=8" in text
    sharded = rows["fsdp=4,tensor=2"]
    assert int(sharded["train_temp_bytes"]) > 0 and float(sharded["flops"]) > 0
    assert "all-gather" in sharded["collectives"]
