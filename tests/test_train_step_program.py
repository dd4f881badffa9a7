"""The planner plans the program that trains: the trainer's jitted step on live modules and the
planner's on abstract ``ShapeDtypeStruct`` states lower to the same StableHLO (locations aside)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.training.run_config import load_run_config


def _program(lowered) -> str:
    """StableHLO text without source locations (file/line of the tracing call differ)."""
    text = lowered.as_text()
    text = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def test_trainer_and_planner_lower_the_same_train_step(tmp_path):
    from convert.tiny_target import make_tiny_target_dir
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.loading import load_target
    from dflash_jax.sharding import make_mesh, shard_module
    from dflash_jax.tools import plan
    from dflash_jax.training.step import make_optimizer, make_train_step

    cfg = load_run_config("tiny", [f"output_dir={tmp_path}", "mesh=data=2,fsdp=2,tensor=2"])
    mesh = make_mesh(cfg.mesh)
    target = load_target(make_tiny_target_dir(cfg.target, 512, tmp_path / "t"), mesh=mesh)
    spec = plan.spec_for_run(cfg, target_config=target.config)
    R, T = spec.batch_rows, spec.seq_len

    # The trainer's side, as training/run.py builds it: live modules placed on the mesh.
    drafter = init_drafter(spec.drafter_config, target, 0)
    shard_module(drafter, mesh)
    optimizer = nnx.Optimizer(drafter, make_optimizer(cfg.train), wrt=nnx.Param)
    shard_module(optimizer, mesh)
    ids = jax.device_put(np.zeros((R, T), np.int32), plan.batch_sharding(mesh))
    batch = {"input_ids": ids, "positions": ids, "segment_ids": ids, "loss_mask": ids}
    with jax.set_mesh(mesh):  # as the training loop runs
        key = jax.random.fold_in(jax.random.key(cfg.train.seed), 3)
        trained = make_train_step(cfg.train).lower(
            drafter, optimizer, target, batch, key, np.float32(cfg.train.learning_rate)
        )
        # The planner's side: the same configs, nothing allocated.
        t_graph, t_state = plan.abstract_target(spec, mesh)
        d_graph, d_state = plan.abstract_drafter_and_optimizer(spec, mesh)
        batch_shape, key_shape = plan.abstract_batch(spec, mesh), plan.abstract_key(mesh)
        planned = plan.lower_train_step(spec, d_graph, d_state, t_graph, t_state, batch_shape, key_shape)

    ours, theirs = _program(trained), _program(planned)
    assert "stablehlo" in ours and len(ours) > 10_000  # a whole train step, not an empty module
    # Donation: the drafter's and optimizer's buffers alias the new state's in both.
    assert ours.count("tf.aliasing_output") == theirs.count("tf.aliasing_output") > 0
    assert ours.count("sdy.sharding") == theirs.count("sdy.sharding") > 0
    assert ours == theirs
    # The learning rate is traced in both: an f32 scalar argument, not a constant.
    assert [a.shape for a in jax.tree.leaves(trained.in_avals)] == [
        a.shape for a in jax.tree.leaves(planned.in_avals)
    ]
    assert jnp.dtype(jax.tree.leaves(planned.in_avals)[-1].dtype) == jnp.float32
