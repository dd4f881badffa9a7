"""The run assembler (training/assembly.py): one description of a run's parts for the trainer,
the feature cache and the planner. Abstract (no weights: the planner) and concrete (the trainer)
must describe the same target and drafter."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_jax.training.assembly import assemble, load_parts
from dflash_jax.training.run_config import load_run_config


def test_abstract_parts_of_a_real_config_read_no_weights():
    parts = assemble(load_run_config("qwen3-8b"), abstract=True)
    assert not parts.loaded and parts.target is None and parts.tokenizer is None
    assert (parts.target_config.num_layers, parts.target_config.hidden_size) == (36, 4096)
    # z-lab's build_target_layer_ids(36, 5) and the published Qwen3-8B drafter's block size
    assert tuple(parts.drafter_config.target_layer_ids) == (1, 9, 17, 25, 33)
    assert parts.drafter_config.block_size == 16
    assert parts.data == load_run_config("qwen3-8b").data


def test_a_tiny_target_is_described_from_its_section():
    parts = assemble(load_run_config("tiny"), abstract=True)
    assert (parts.target_config.hidden_size, parts.target_config.vocab_size) == (64, 49152)


def test_abstract_and_concrete_describe_the_same_run(tmp_path):
    cfg = load_run_config("tiny", [f"output_dir={tmp_path / 'run'}"])
    concrete = load_parts(cfg, assemble(cfg, run_dir=tmp_path / "run"))
    assert concrete.loaded and concrete.tokenizer is not None
    assert concrete.target.config == concrete.target_config
    abstract = assemble(cfg, abstract=True)
    assert abstract.target_config == concrete.target_config
    # the mask token is the only field the abstract description picks without a tokenizer
    mask = concrete.drafter_config.mask_token_id
    assert dataclasses.replace(abstract.drafter_config, mask_token_id=mask) == concrete.drafter_config
    assert abstract.data == concrete.data == cfg.data  # tiny: no regeneration


def test_a_run_with_the_preflight_is_resolved_once(tmp_path, monkeypatch):
    from dflash_jax.tools import plan
    from dflash_jax.train import run
    from dflash_jax.training import assembly

    calls, planned = [], []
    real = assembly.assemble
    monkeypatch.setattr(assembly, "assemble", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_spec = plan.spec_for_run
    monkeypatch.setattr(
        plan, "spec_for_run", lambda cfg, **k: planned.append(k.get("parts")) or real_spec(cfg, **k)
    )
    cfg = load_run_config("tiny", [f"output_dir={tmp_path / 'run'}", "train.steps=1"])
    run(cfg, quiet=True, preflight=plan.check_run_fits, device_memory=2**40)
    assert len(calls) == 1
    assert len(planned) == 1 and planned[0] is not None  # the pre-flight planned the run's own parts


def test_an_architecture_that_disagrees_with_config_json_is_named(tmp_path):
    import json

    from dflash_jax.config_io import ConfigError

    arch = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**arch, "num_hidden_layers": 6, "rope_theta": 5e5}))
    inline = "{" + ", ".join(f"{k}: {v}" for k, v in arch.items()) + "}"
    cfg = load_run_config("qwen3-8b", [f"target.path={tmp_path}", f"target.architecture={inline}"])
    with pytest.raises(ConfigError) as refused:
        assemble(cfg, abstract=True)
    message = str(refused.value)
    assert "num_layers (2 against 6)" in message
    assert "rope.theta (" in message and "rope_type" not in message  # a nested config by what differs
    assert "against 6 entries)" in message  # a long sequence by its length


def test_a_warm_start_fixes_the_drafter_in_both_descriptions(tmp_path):
    from dflash_jax.train import run

    first = load_run_config(
        "tiny",
        [f"output_dir={tmp_path / 'a'}", "train.steps=1", "drafter.block_size=3", "train.checkpoint_every=1"],
    )
    run(first, quiet=True)
    cfg = load_run_config("tiny", [f"output_dir={tmp_path / 'b'}", f"drafter.init_from={tmp_path / 'a'}"])
    cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, block_size=None))
    concrete = load_parts(cfg, assemble(cfg, run_dir=tmp_path / "b"))
    assert concrete.warm_source is not None and concrete.drafter_config.block_size == 3
    abstract = assemble(cfg, abstract=True)
    assert abstract.drafter_config == concrete.drafter_config
