"""The run assembler (training/assembly.py): one description of a run's parts for the trainer,
the feature cache and the planner. Abstract (no weights: the planner) and concrete (the trainer)
must describe the same target and drafter."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_jax.training.assembly import NoArchitecture, assemble
from dflash_jax.training.run_config import load_run_config


def test_abstract_parts_of_a_real_config_read_no_weights():
    parts = assemble(load_run_config("qwen3-8b"), abstract=True)
    assert parts.abstract and parts.target is None and parts.tokenizer is None
    assert (parts.target_config.num_layers, parts.target_config.hidden_size) == (36, 4096)
    # z-lab's build_target_layer_ids(36, 5) and the published Qwen3-8B drafter's block size
    assert tuple(parts.drafter_config.target_layer_ids) == (1, 9, 17, 25, 33)
    assert parts.drafter_config.block_size == 16
    assert parts.data == load_run_config("qwen3-8b").data


def test_a_tiny_target_has_no_architecture_before_its_tokenizer():
    with pytest.raises(NoArchitecture, match=r"target.path=tiny"):
        assemble(load_run_config("tiny"), abstract=True)


def test_abstract_and_concrete_describe_the_same_run(tmp_path):
    cfg = load_run_config("tiny", [f"output_dir={tmp_path / 'run'}"])
    concrete = assemble(cfg, run_dir=tmp_path / "run")
    assert not concrete.abstract and concrete.tokenizer is not None
    assert concrete.target.config == concrete.target_config
    abstract = assemble(cfg, abstract=True, target_dir=concrete.target_dir)
    assert abstract.target_config == concrete.target_config
    # the mask token is the only field the abstract description picks without a tokenizer
    mask = concrete.drafter_config.mask_token_id
    assert dataclasses.replace(abstract.drafter_config, mask_token_id=mask) == concrete.drafter_config
    assert abstract.data == concrete.data == cfg.data  # tiny: no regeneration


def test_a_warm_start_fixes_the_drafter_in_both_descriptions(tmp_path):
    from dflash_jax.train import run

    first = load_run_config(
        "tiny",
        [f"output_dir={tmp_path / 'a'}", "train.steps=1", "drafter.block_size=3", "train.checkpoint_every=1"],
    )
    run(first, quiet=True)
    cfg = load_run_config("tiny", [f"output_dir={tmp_path / 'b'}", f"drafter.init_from={tmp_path / 'a'}"])
    cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, block_size=None))
    concrete = assemble(cfg, run_dir=tmp_path / "b")
    assert concrete.warm_source is not None and concrete.drafter_config.block_size == 3
    abstract = assemble(cfg, abstract=True, target_dir=concrete.target_dir)
    assert abstract.drafter_config == concrete.drafter_config
