"""The offline feature cache (python -m dflash_jax.features, data.features): training from it equals
online training, it is refused when made for another run, and a damaged cache is named."""

from __future__ import annotations

import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest

from dflash_jax.features import build, main
from dflash_jax.nested import flatten
from dflash_jax.tools import plan
from dflash_jax.train import run
from dflash_jax.training import step
from dflash_jax.training.feature_cache import (
    DISK_MARGIN_MIN,
    CachedBatchIterator,
    CacheDiskError,
    CacheWriter,
    FeatureCache,
    FeatureCacheError,
    bound_rows,
)
from dflash_jax.training.run_config import load_run_config

# 40 records of ShareGPT pack into 3 batches of 8 rows: one epoch, so online and cached rows agree
# to the last batch.
SMALL = [
    "mesh.num_devices=1",
    "mesh.data=1",
    "train.log_every=1",
    "data.max_records=40",
    "data.num_epochs=1",
    "train.steps=3",
    "train.warmup_steps=1",
]


def tiny(out, *overrides):
    return load_run_config("tiny", [f"output_dir={out}", *SMALL, *overrides])


def losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("feature_cache")
    manifest = build(tiny(root / "build"), root / "cache", quiet=True)
    return root / "cache", manifest


def test_cache_training_equals_online(cache, tmp_path, monkeypatch):
    """Same seed, feature_noise 0: the cached run's loss curve is the online one (1e-5), and the
    target forward never runs in it."""
    path, manifest = cache
    assert manifest["rows"] == 24 and manifest["identity"]["taps"] == [2]
    online = run(tiny(tmp_path / "online"), quiet=True)

    def no_target(*args, **kwargs):
        raise AssertionError("the target forward ran in a run with data.features")

    monkeypatch.setattr(step, "target_pass", no_target)
    cached = run(tiny(tmp_path / "cached", f"data.features={path}"), quiet=True)
    lo, lc = losses(tmp_path / "online"), losses(tmp_path / "cached")
    assert sorted(lo) == sorted(lc) == [1, 2, 3]
    np.testing.assert_allclose([lc[s] for s in lc], [lo[s] for s in lo], atol=1e-5, rtol=0)
    assert online["step"] == cached["step"] == 3


def stored_bytes_per_row(manifest) -> dict:
    """Per array, the bytes a row of a written cache holds (the .npy headers left out)."""
    out = {}
    for shard in manifest["shards"]:
        for name, entry in shard["files"].items():
            item = np.dtype(getattr(ml_dtypes, manifest["dtypes"][name], manifest["dtypes"][name])).itemsize
            out[name] = out.get(name, 0) + math.prod(entry["shape"]) * item
            assert 0 < entry["bytes"] - math.prod(entry["shape"]) * item <= 256  # one header
    return {name: total // manifest["rows"] for name, total in out.items()}


def test_disk_estimate_is_what_the_writer_stores(cache):
    """The bytes a row that --plan and the disk pre-flight count (from the config, no weight read)
    are those of the cache's files, array by array; its rows stay within the one-document-a-row
    bound."""
    path, manifest = cache
    assert plan.cache_row_bytes(tiny(path.parent / "build")) == stored_bytes_per_row(manifest)
    assert manifest["rows"] == 24 <= bound_rows(40, 8) == 40
    assert bound_rows(41, 8) == 48 and bound_rows(10, 8, num_shards=2) == 16  # 5 documents a shard


def fake_disk(monkeypatch, free: int) -> None:
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * free, 9 * free, free)
    )


def test_disk_preflight_refuses_before_writing(tmp_path, monkeypatch):
    """A cache bigger than the free space (made small here) is refused before a byte is written,
    naming the directory, both sizes and $DFLASH_JAX_CACHE; under data.features_minutes the build
    writes the whole batches that fit instead."""
    caches = tmp_path / "caches"
    caches.mkdir()
    fake_disk(monkeypatch, 1_000_000)
    with pytest.raises(CacheDiskError) as e:
        build(tiny(tmp_path / "run"), caches / "c", quiet=True)
    msg = str(e.value)
    assert f"feature cache {caches / 'c'}: 24 rows x " in msg  # counted: the 40-row bound did not fit
    assert "1 MB free on" in msg and "nothing written" in msg and "$DFLASH_JAX_CACHE/features" in msg
    assert "data.max_records" in msg and "data.max_length, now 128" in msg and "data.features_minutes" in msg
    assert list(caches.iterdir()) == []

    capped = tiny(tmp_path / "run", "data.features=auto", "data.features_minutes=60")
    fake_disk(monkeypatch, DISK_MARGIN_MIN + 12 * sum(plan.cache_row_bytes(capped).values()))
    manifest = build(capped, caches / "c", quiet=True)
    assert manifest["rows"] == 8 and manifest["complete_epoch"] is False  # one batch of 8 fits


@pytest.mark.slow
def test_kl_cache_training_equals_online(tmp_path):
    """train.loss=kl stores the final normed hidden state and the target's argmax; the loss from
    them equals online (1e-5), with a draft vocabulary (whose mask reads the argmax) too."""
    kl = ["train.loss=kl", "drafter.draft_vocab_size=64"]
    manifest = build(tiny(tmp_path / "build", *kl), tmp_path / "cache", quiet=True)
    assert {"hidden", "labels"} <= set(FeatureCache(tmp_path / "cache").names)
    assert plan.cache_row_bytes(tiny(tmp_path / "build", *kl)) == stored_bytes_per_row(manifest)
    run(tiny(tmp_path / "online", *kl), quiet=True)
    run(tiny(tmp_path / "cached", *kl, f"data.features={tmp_path / 'cache'}"), quiet=True)
    lo, lc = losses(tmp_path / "online"), losses(tmp_path / "cached")
    assert sorted(lo) == sorted(lc) == [1, 2, 3]
    np.testing.assert_allclose([lc[s] for s in lc], [lo[s] for s in lo], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_cache_run_resumes_exactly(cache, tmp_path):
    """Stop + resume from the cache (its position is in the checkpoint) equals the straight run."""
    path, _ = cache
    straight = run(tiny(tmp_path / "straight", f"data.features={path}"), quiet=True)
    assert straight["step"] == 3
    lc = losses(tmp_path / "straight")
    first = run(tiny(tmp_path / "resumed", f"data.features={path}"), quiet=True, stop_at_step=1)
    assert first["step"] == 1
    second = run(tiny(tmp_path / "resumed", f"data.features={path}"), quiet=True, resume=True)
    assert second["start_step"] == 1 and second["step"] == 3
    lr = losses(tmp_path / "resumed")
    assert [lr[s] for s in (1, 2, 3)] == [lc[s] for s in (1, 2, 3)]


@pytest.mark.parametrize(
    "override, field",
    [
        ("target.tiny_seed=1", "target.files.model.safetensors"),  # another target (same shapes)
        ("drafter.target_layer_ids=[0,3]", "taps"),
        ("data.seed=1", "data.seed"),
        ("train.loss=kl", "labels.loss"),
    ],
)
def test_cache_for_another_run_is_refused(cache, tmp_path, override, field):
    path, manifest = cache
    with pytest.raises(FeatureCacheError, match=rf"{path}.*{field}: cache has (.+), this run has (.+)") as e:
        run(tiny(tmp_path, f"data.features={path}", override), quiet=True)
    cached = flatten(manifest["identity"], empty_as_leaf=True)[field]
    assert repr(cached) in str(e.value)


def test_ce_labels_identity_follows_the_target_not_the_drafters_dtype():
    """ce labels are the target's argmax in its own dtype: a bf16 drafter reuses an fp32 drafter's
    cache, and caches of the older compute-dtype labels ({"compute_dtype": ...}) do not match."""
    from dflash_jax.training.feature_cache import labels_identity
    from dflash_jax.training.run_config import TrainSection

    fp32, bf16 = TrainSection(compute_dtype="float32"), TrainSection(compute_dtype="bfloat16")
    assert labels_identity(fp32) == labels_identity(bf16) == {"loss": "ce", "argmax_dtype": "target"}
    # kl caches store the same argmax beside the hidden state; earlier ones stored only the latter
    assert labels_identity(TrainSection(loss="kl")) == {"loss": "kl", "argmax_dtype": "target"}


def test_target_fingerprint_is_the_files_content_not_when_they_were_prepared(tmp_path):
    from dflash_jax.training.feature_cache import target_fingerprint

    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / ".dflash_jax_prepared.json").write_text('{"created_unix": 1}')
    first = target_fingerprint(tmp_path, "bfloat16")
    (tmp_path / ".dflash_jax_prepared.json").write_text('{"created_unix": 2}')  # prepared again
    assert target_fingerprint(tmp_path, "bfloat16") == first
    assert sorted(first["files"]) == ["config.json", "model.safetensors"]
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert target_fingerprint(tmp_path, "bfloat16") != first
    assert target_fingerprint(tmp_path, "float32")["dtype"] == "float32"


def _write(tmp_path, rows=12, batch=4, rows_per_shard=8):
    """A small cache written through CacheWriter (two shards), and the rows it holds."""
    rng = np.random.default_rng(0)
    data = {
        "input_ids": rng.integers(0, 100, (rows, 6)).astype(np.int32),
        "positions": np.tile(np.arange(6, dtype=np.int32), (rows, 1)),
        "segment_ids": np.ones((rows, 6), np.int32),
        "loss_mask": rng.integers(0, 2, (rows, 6)).astype(np.int32),
        "features": rng.normal(size=(rows, 6, 5)).astype(ml_dtypes.bfloat16),
        "labels": rng.integers(0, 100, (rows, 6)).astype(np.int32),
    }
    w = CacheWriter(tmp_path / "c", rows_per_shard=rows_per_shard)
    for b in range(0, rows, batch):
        w.add({k: v[b : b + batch] for k, v in data.items()})
    w.finish({"identity": {"taps": [1]}, "batch_size": batch, "computed_dtypes": {"features": "float32"}})
    return tmp_path / "c", data


def test_manifest_round_trip_and_replay(tmp_path):
    path, data = _write(tmp_path)
    cache = FeatureCache(path)
    assert cache.rows == 12 and len(cache.shards) == 2 and cache.dtypes["features"] == "bfloat16"
    got = cache.read_rows(np.array([11, 0, 7, 8]))  # across both shards, any order
    for k, v in data.items():
        np.testing.assert_array_equal(got[k], v[[11, 0, 7, 8]])
    assert got["features"].dtype == ml_dtypes.bfloat16
    assert not list(tmp_path.glob(".c.tmp-*"))  # written to a temporary dir, then renamed

    cfg = load_run_config("tiny", ["data.batch_size=4", "data.num_epochs=2", "data.seed=3"]).data
    it = CachedBatchIterator(cache, cfg)
    batches = [next(it)["input_ids"] for _ in range(3)]  # epoch 0: the stored order
    np.testing.assert_array_equal(np.concatenate(batches), data["input_ids"])
    state = it.get_state()
    epoch1 = [next(it)["input_ids"] for _ in range(3)]  # epoch 1: the same rows, shuffled by data.seed
    with pytest.raises(StopIteration):
        next(it)
    order = np.random.default_rng([3, 1]).permutation(12)
    np.testing.assert_array_equal(np.concatenate(epoch1), data["input_ids"][order])
    again = CachedBatchIterator(cache, cfg)
    again.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it
    np.testing.assert_array_equal(next(again)["input_ids"], epoch1[0])
    # Process 1 of 2 reads the second half of each global batch.
    half = CachedBatchIterator(cache, cfg, process_index=1, process_count=2)
    np.testing.assert_array_equal(next(half)["input_ids"], data["input_ids"][2:4])


def test_damaged_cache_is_named(tmp_path):
    path, _ = _write(tmp_path)
    shard = path / "00001-features.npy"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(FeatureCacheError, match="00001-features.npy has .* bytes, the manifest says"):
        FeatureCache(path)
    shard.unlink()
    with pytest.raises(FeatureCacheError, match=r"shard file 00001-features.npy \(features\) is missing"):
        FeatureCache(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(FeatureCacheError, match="manifest.json is not a feature cache manifest"):
        FeatureCache(path)
    (path / "manifest.json").unlink()
    with pytest.raises(FeatureCacheError, match="no manifest.json there"):
        FeatureCache(path)
    with pytest.raises(FeatureCacheError, match="already exists: pass --overwrite"):
        CacheWriter(path, rows_per_shard=4)


def test_26_10_flipped_bits_in_a_shard_are_named(tmp_path):
    """Issue 26: the open-time check compares sizes only; a shard with flipped bits (same size)
    fails its checksum when first read, naming the file."""
    path, data = _write(tmp_path)
    shard = path / "00001-features.npy"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x10
    shard.write_bytes(bytes(raw))
    cache = FeatureCache(path)  # sizes still match
    np.testing.assert_array_equal(cache.read_rows(np.array([0]))["input_ids"], data["input_ids"][[0]])
    with pytest.raises(
        FeatureCacheError, match=r"00001-features.npy \(features\) does not match the checksum"
    ):
        cache.read_rows(np.array([9]))


def test_features_minutes_caps_the_build_and_names_its_rows(cache, tmp_path):
    """data.features_minutes: the build stops at the first batch past its budget (here: right after
    the first batch), the manifest says the epoch is incomplete, the cap is part of the cache's
    identity (an uncapped run refuses it), and a run trains from those rows; an uncapped cache's
    identity has no such field (caches built before it existed still match)."""
    _, full = cache
    assert "features_minutes" not in full["identity"]["data"] and full["complete_epoch"] is True
    capped = ["data.features=auto", "data.features_minutes=1e-6"]
    manifest = build(tiny(tmp_path / "build", *capped), tmp_path / "capped", quiet=True)
    assert manifest["rows"] == 8 and manifest["complete_epoch"] is False  # one batch of 8 of 3
    assert manifest["identity"]["data"]["features_minutes"] == 1e-6
    path = tmp_path / "capped"
    with pytest.raises(
        FeatureCacheError, match=r"data.features_minutes: cache has 1e-06, this run has '<absent>'"
    ):
        run(tiny(tmp_path / "uncapped", f"data.features={path}"), quiet=True)
    done = run(tiny(tmp_path / "run", f"data.features={path}", "data.features_minutes=1e-6"), quiet=True)
    assert done["step"] == 1  # one epoch of one batch (data.num_epochs=1)


def test_features_minutes_is_validated():
    with pytest.raises(ValueError, match="features_minutes must be > 0"):
        load_run_config("tiny", ["data.features=auto", "data.features_minutes=0"])
    with pytest.raises(ValueError, match="data.features_minutes caps the build .* set data.features: auto"):
        load_run_config("tiny", ["data.features_minutes=5"])


def test_features_field_is_validated():
    with pytest.raises(ValueError, match="features"):
        load_run_config("tiny", ["data.features="])
    assert load_run_config("tiny").data.features is None


def test_cli_refuses_an_existing_out_before_loading(tmp_path, capsys):
    (tmp_path / "cache").mkdir()
    assert main(["--config", "tiny", "--out", str(tmp_path / "cache"), f"output_dir={tmp_path}"]) == 2
    assert "already exists: pass --overwrite" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("tiny_target-*"))
