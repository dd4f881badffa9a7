"""Dense targets (Qwen3, Llama 3, Qwen2) vs transformers (PyTorch, CPU, fp32) on tiny random configs:
sharded layouts, sharded checkpoints and packed documents, the KV cache, bad checkpoints (their
parity on a long prompt: test_target_parity.py)."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import make_hf_model, prompt_ids, save_hf_model
from target_families import (
    FAMILIES,
    assert_same_outputs,
    checkpoint,
    hf_reference,
    rewrite_safetensors,
    run_packed,
    run_target,
)

import dflash_jax
from dflash_jax.sharding import MeshConfig, make_mesh

LAYER_IDS = FAMILIES["qwen3"].layer_ids


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
@pytest.mark.parametrize(
    "layout",
    [
        MeshConfig(data=2, fsdp=2, tensor=2),
        MeshConfig(data=1, fsdp=4, tensor=2),
        MeshConfig(data=2, fsdp=1, tensor=4),
    ],
    ids=["d2f2t2", "f4t2", "d2t4"],
)
def test_mesh_layouts_match_single_device(kind, layout, tmp_path_factory):
    path, hf_model = checkpoint(tmp_path_factory, kind)
    ids = prompt_ids(256, hf_model.config.vocab_size, seed=2, batch=4)
    single = run_target(dflash_jax.load_target(path), ids, LAYER_IDS)
    mesh = make_mesh(layout)
    sharded_target = dflash_jax.load_target(path, mesh=mesh)
    q = sharded_target.layers.q[...]
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated
    assert_same_outputs(run_target(sharded_target, ids, LAYER_IDS, mesh=mesh), single, atol=2e-5)


def test_sharded_checkpoint_and_packed_segments(tmp_path):
    hf_model = make_hf_model("qwen3", seed=3)
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    target = dflash_jax.load_target(tmp_path)
    a = prompt_ids(96, 512, seed=4)
    b = prompt_ids(64, 512, seed=5)
    # Two documents packed in one row: each must see only itself, with positions restarting.
    out, rows = run_packed(target, [a[0], b[0]], layer_ids=(1,))
    for doc, sl in zip((a, b), rows, strict=True):
        ref, _ = hf_reference(hf_model, doc)
        np.testing.assert_allclose(np.asarray(out.logits[0, sl]), ref.logits.numpy()[0], atol=1e-4, rtol=0)


def test_kv_cache_decode_matches_full_forward(tmp_path):
    hf_model = make_hf_model("llama3", seed=6)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    target = dflash_jax.load_target(tmp_path)
    ids = prompt_ids(300, 512, seed=7, batch=2)
    full = run_target(target, ids, layer_ids=(1,))
    cache = target.init_cache(batch=2, capacity=320)
    step = nnx.jit(lambda m, x, c: m(x, cache=c, layer_ids=(1,)))
    o1 = step(target, jnp.asarray(ids[:, :250], jnp.int32), cache)
    # Speculate 10 wrong tokens, then crop back (as a rejected draft would) and continue.
    junk = step(target, jnp.zeros((2, 10), jnp.int32), o1.cache)
    cropped = junk.cache.with_lengths(o1.cache.lengths)
    o2 = step(target, jnp.asarray(ids[:, 250:], jnp.int32), cropped)
    assert np.asarray(o2.cache.lengths).tolist() == [300, 300]
    got = np.concatenate([np.asarray(o1.logits), np.asarray(o2.logits)], axis=1)
    np.testing.assert_allclose(got, np.asarray(full.logits), atol=1e-4, rtol=0)
    feats = np.concatenate([np.asarray(o1.features), np.asarray(o2.features)], axis=1)
    np.testing.assert_allclose(feats, np.asarray(full.features), atol=1e-4, rtol=0)


def test_forward_past_the_cache_capacity_keeps_its_in_capacity_positions_exact(tmp_path):
    """A verify step that runs past the buffer (the end of a long generation) drops what does not
    fit; the positions that do fit attend to the right keys (nothing written back over the prompt)."""
    hf_model = make_hf_model("llama3", seed=6)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    target = dflash_jax.load_target(tmp_path)
    ids = prompt_ids(270, 512, seed=7, batch=2)
    full = run_target(target, ids, layer_ids=(1,))
    step = nnx.jit(lambda m, x, c: m(x, cache=c, layer_ids=(1,)))
    o1 = step(target, jnp.asarray(ids[:, :250], jnp.int32), target.init_cache(batch=2, capacity=260))
    o2 = step(target, jnp.asarray(ids[:, 250:], jnp.int32), o1.cache)  # 20 tokens, 10 fit
    np.testing.assert_allclose(
        np.asarray(o2.logits[:, :10]), np.asarray(full.logits[:, 250:260]), atol=1e-4, rtol=0
    )


# ---- bad input --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return save_hf_model("qwen3", tmp_path_factory.mktemp("good"), seed=8)


def _with_config(src, dst, **changes):
    """A copy of checkpoint ``src`` at ``dst`` with ``changes`` written into its config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_missing_tensor_is_named(good_dir, tmp_path):
    bad = rewrite_safetensors(
        good_dir, tmp_path / "bad", lambda t: t.pop("model.layers.2.mlp.up_proj.weight")
    )
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.up_proj\.weight"):
        dflash_jax.load_target(bad)


def test_unexpected_tensor_is_named(good_dir, tmp_path):
    bad = rewrite_safetensors(
        good_dir, tmp_path / "bad", lambda t: t.__setitem__("model.extra.weight", np.zeros(3, np.float32))
    )
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.extra\.weight"):
        dflash_jax.load_target(bad)


def test_wrong_shape_is_named(good_dir, tmp_path):
    def edit(t):
        t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    bad = rewrite_safetensors(good_dir, tmp_path / "bad", edit)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*shape \(8, 64\), expected \(64, 64\)"
    ):
        dflash_jax.load_target(bad)


def test_unsupported_model_type(good_dir, tmp_path):
    bad = _with_config(good_dir, tmp_path / "bad", model_type="mixtral")
    with pytest.raises(ValueError, match="unsupported model_type 'mixtral'"):
        dflash_jax.load_target(bad)


def test_unsupported_rope_scaling(good_dir, tmp_path):
    rope = {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}
    bad = _with_config(good_dir, tmp_path / "bad", rope_parameters=rope)
    with pytest.raises(ValueError, match="rope_type: unknown 'longrope'"):
        dflash_jax.load_target(bad)


def test_corrupt_safetensors(good_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        dflash_jax.load_target(bad)
