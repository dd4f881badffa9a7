"""Target models vs transformers (PyTorch, CPU, fp32) on tiny random configs with long prompts."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import make_hf_model, prompt_ids, save_hf_model

import dflash_jax
from dflash_jax.sharding import MeshConfig, make_mesh

KINDS = ["qwen3", "qwen3_tied", "llama3", "qwen2"]
LAYER_IDS = (3, 0, 2)  # out of order on purpose, and includes the last layer (3 of 4)
PROMPT_LEN = 520


def run_target(target, ids, layer_ids=LAYER_IDS, mesh=None, **kw):
    fn = nnx.jit(lambda m, x: m(x, layer_ids=layer_ids, **kw))
    if mesh is None:
        return fn(target, jnp.asarray(ids, jnp.int32))
    with jax.set_mesh(mesh):
        return fn(target, jnp.asarray(ids, jnp.int32))


def hf_reference(model, ids):
    """HF logits, hidden_states, and the raw (pre-norm) output of every decoder layer."""
    raw = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: raw.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out).numpy()
            )
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    for h in hooks:
        h.remove()
    return out, raw


_CHECKPOINTS: dict = {}


def _checkpoint(kind, tmp_path_factory):
    if kind not in _CHECKPOINTS:
        d = tmp_path_factory.mktemp(kind)
        model = make_hf_model(kind)
        model.save_pretrained(d, safe_serialization=True)
        _CHECKPOINTS[kind] = (kind, d, model)
    return _CHECKPOINTS[kind]


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory)


def test_parity_with_transformers(checkpoint):
    kind, path, hf_model = checkpoint
    ids = prompt_ids(PROMPT_LEN, hf_model.config.vocab_size, seed=1)
    ref, raw = hf_reference(hf_model, ids)
    target = dflash_jax.load_target(path)
    out = run_target(target, ids)
    H = hf_model.config.hidden_size

    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    # .hidden is what lm_head sees: HF's hidden_states[-1] (after the final norm).
    np.testing.assert_allclose(np.asarray(out.hidden), ref.hidden_states[-1].numpy(), atol=1e-4, rtol=0)
    assert out.features.shape == (1, PROMPT_LEN, len(LAYER_IDS) * H)
    for j, layer in enumerate(LAYER_IDS):
        ours = np.asarray(out.features[..., j * H : (j + 1) * H])
        # Raw output of layer i; equals hidden_states[i+1] except for the last (normed) one.
        np.testing.assert_allclose(ours, raw[layer], atol=1e-4, rtol=0)
        if layer < hf_model.config.num_hidden_layers - 1:
            np.testing.assert_allclose(ours, ref.hidden_states[layer + 1].numpy(), atol=1e-4, rtol=0)
        else:
            assert np.abs(ours - ref.hidden_states[-1].numpy()).max() > 1e-2, (
                "last-layer tap must be pre-norm"
            )

    cfg = target.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.model_type) == (
        hf_model.config.num_hidden_layers,
        H,
        hf_model.config.vocab_size,
        hf_model.config.model_type,
    )


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
    kind, path, hf_model = _checkpoint(kind, tmp_path_factory)
    ids = prompt_ids(256, hf_model.config.vocab_size, seed=2, batch=4)
    single = run_target(dflash_jax.load_target(path), ids)
    mesh = make_mesh(layout)
    sharded_target = dflash_jax.load_target(path, mesh=mesh)
    q = sharded_target.layers.q[...]
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated
    out = run_target(sharded_target, ids, mesh=mesh)
    for name in ("logits", "hidden", "features"):
        np.testing.assert_allclose(
            np.asarray(getattr(out, name)), np.asarray(getattr(single, name)), atol=2e-5, rtol=0, err_msg=name
        )


def test_sharded_checkpoint_and_packed_segments(tmp_path):
    hf_model = make_hf_model("qwen3", seed=3)
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    target = dflash_jax.load_target(tmp_path)
    a = prompt_ids(96, 512, seed=4)
    b = prompt_ids(64, 512, seed=5)
    # Two documents packed in one row: each must see only itself, with positions restarting.
    packed = np.concatenate([a, b], axis=1)
    seg = np.concatenate([np.ones(96), 2 * np.ones(64)])[None].astype(np.int32)
    pos = np.concatenate([np.arange(96), np.arange(64)])[None].astype(np.int32)
    fn = nnx.jit(lambda m, x, p, s: m(x, p, segment_ids=s, layer_ids=(1,)))
    out = fn(target, jnp.asarray(packed, jnp.int32), jnp.asarray(pos), jnp.asarray(seg))
    ref_a, _ = hf_reference(hf_model, a)
    ref_b, _ = hf_reference(hf_model, b)
    np.testing.assert_allclose(np.asarray(out.logits[0, :96]), ref_a.logits.numpy()[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out.logits[0, 96:]), ref_b.logits.numpy()[0], atol=1e-4, rtol=0)


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


def _rewrite(src, dst, edit):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(good_dir, tmp_path):
    bad = _rewrite(good_dir, tmp_path / "bad", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.up_proj\.weight"):
        dflash_jax.load_target(bad)


def test_unexpected_tensor_is_named(good_dir, tmp_path):
    bad = _rewrite(
        good_dir, tmp_path / "bad", lambda t: t.__setitem__("model.extra.weight", np.zeros(3, np.float32))
    )
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.extra\.weight"):
        dflash_jax.load_target(bad)


def test_wrong_shape_is_named(good_dir, tmp_path):
    def edit(t):
        t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    bad = _rewrite(good_dir, tmp_path / "bad", edit)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*shape \(8, 64\), expected \(64, 64\)"
    ):
        dflash_jax.load_target(bad)


def test_unsupported_model_type(good_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'mixtral'"):
        dflash_jax.load_target(bad)


def test_unsupported_rope_scaling(good_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type: unknown 'longrope'"):
        dflash_jax.load_target(bad)


def test_corrupt_safetensors(good_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        dflash_jax.load_target(bad)
