"""``train --plan`` on every shipped config reads no weight and writes nothing: the cache root is
an empty, unwritable directory and every weight reader refuses. Small rows keep the real-size
configs' compiles short; the architecture stays the config's own."""

from __future__ import annotations

import pytest

from dflash_jax.training.run_config import shipped_configs

SMALL = ["data.batch_size=8", "data.max_length=64", "train.max_anchors=4", "train.micro_batches=1"]


# In the default suite: the CPU demo's SmolLM2 path, the tiny families' and one real-size config
# (each real-size compile costs ~40 s on a 2-core CI box); every other shipped config runs with
# ``-m slow``, the whole sweep then.
DEFAULT_SUITE = {"demo", "tiny", "tiny-moe", "tiny-hybrid", "qwen3-8b"}


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT_SUITE else pytest.param(n, marks=pytest.mark.slow) for n in shipped_configs()]
)
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
    out = capsys.readouterr().out
    assert "plan for layout" in out and "feature cache (" in out and "  a row: " in out
    assert list(cache.iterdir()) == []


def test_qwen3_8b_feature_cache_at_real_size(monkeypatch):
    """The shipped qwen3-8b config's cache as --plan prints it (no weight, no data read): 168 MB a
    row at T=4096 (5 taps x hidden 4096 in bfloat16, plus int32 row arrays and labels), 201 MB with
    kl's hidden state; 20,000 regenerated documents bound it at 3.36 TB, against the free space."""
    import shutil

    from dflash_jax.tools import plan
    from dflash_jax.training.run_config import load_run_config

    cfg = load_run_config("qwen3-8b")
    ce = sum(plan.cache_row_bytes(cfg).values())
    assert ce == 4096 * (5 * 4096 * 2 + 5 * 4) == 167_854_080
    kl = sum(plan.cache_row_bytes(load_run_config("qwen3-8b", ["train.loss=kl"])).values())
    assert kl - ce == 4096 * 4096 * 2 and round(kl / 1e6) == 201

    def free(n):
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2 * n, n, n))
        return plan.describe_feature_cache(cfg, records=(20_000, "regen.num_prompts=20000"))

    text = free(4 * 10**12)
    assert "a row: 168 MB at T=4096 in bfloat16" in text and "at most 20,000 rows x 168 MB = 3.36 TB" in text
    assert "fits the free space now" in text
    text = free(10**12)  # 1e12 / 1.02 margin / 167,854,080 = 5,840.7
    assert "does not fit the free space now" in text and "holds about 5,840 rows" in text
    assert "DFLASH_JAX_CACHE" in text
