"""``train --plan`` on every shipped config reads no weight and writes nothing: the cache root is
an empty, unwritable directory and every weight reader refuses. Small rows keep the real-size
configs' compiles short; the architecture stays the config's own."""

from __future__ import annotations

import pytest

from dflash_jax.training.run_config import shipped_configs

SMALL = ["data.batch_size=8", "data.max_length=64", "train.max_anchors=4", "train.micro_batches=1"]


@pytest.mark.parametrize("name", shipped_configs())
def test_plan_reads_no_weight(name, tmp_path, monkeypatch, capsys):
    import convert.safetensors_io as safetensors_io
    import convert.smollm2 as smollm2
    import convert.tiny_target as tiny_target
    import dflash_jax.loading as loading
    from dflash_jax.train import main as train_main

    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(cache))

    def refuse(*a, **k):
        raise AssertionError("--plan read or wrote a weight")

    for module, attr in ((smollm2, "prepare_smollm2"), (smollm2, "smollm2_dir"), (tiny_target, "make_tiny_target_dir"),
                         (loading, "load_target"), (loading, "load_drafter"), (safetensors_io, "CheckpointReader")):  # fmt: skip
        monkeypatch.setattr(module, attr, refuse)
    one_device = ["mesh.num_devices=1"] if name.startswith("demo") else []  # as a user's CPU
    assert train_main(["--config", name, "--plan", *SMALL, *one_device]) == 0, capsys.readouterr().err
    assert "plan for layout" in capsys.readouterr().out
    assert list(cache.iterdir()) == []
