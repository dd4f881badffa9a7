"""gpt-oss vs transformers (PyTorch, CPU, fp32) on a tiny random config: attention sinks,
alternating sliding-window (128) / full layers over a 520-token prompt, YaRN rope, the router with
bias, experts with biases and the clamped SwiGLU; MXFP4-packed experts dequantised bit for bit as
transformers does and loaded with strict key accounting; packed documents; expert parallelism."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import prompt_ids
from moe_fixtures import make_gpt_oss, quantize_mxfp4
from target_families import (
    FAMILIES,
    PROMPT_LEN,
    assert_matches_reference,
    assert_same_outputs,
    assert_same_tensors,
    checkpoint,
    hf_reference,
    run_packed,
    run_target,
)

import dflash_jax
from convert.mxfp4 import dequantize
from dflash_jax.sharding import MeshConfig, make_mesh
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.moe import route

LAYER_IDS = FAMILIES["gpt_oss"].layer_ids


def test_config_has_sinks_windows_and_yarn(tmp_path_factory):
    c = TargetConfig.from_pretrained(checkpoint(tmp_path_factory, "gpt_oss")[0])
    assert c.model_type == "gpt_oss" and c.attention_windows == (128, 0, 128, 0)
    assert c.rope.rope_type == "yarn" and c.rope.scaling > 1 and c.attention_sinks


def test_the_sliding_window_is_load_bearing(tmp_path_factory, tmp_path):
    """The same weights with every layer full attention differ from transformers (whose parity
    with the windows is in test_target_parity.py)."""
    path, hf_model = checkpoint(tmp_path_factory, "gpt_oss")
    ids = prompt_ids(PROMPT_LEN, 512, seed=1)
    ref, _ = hf_reference(hf_model, ids)
    full = tmp_path / "full"
    shutil.copytree(path, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * 4
    (full / "config.json").write_text(json.dumps(cfg))
    unwindowed = run_target(dflash_jax.load_target(full), ids, LAYER_IDS)
    assert np.abs(np.asarray(unwindowed.logits) - ref.logits.numpy()).max() > 1e-3


def test_packed_documents_equal_each_alone(tmp_path_factory):
    path, hf_model = checkpoint(tmp_path_factory, "gpt_oss")
    docs = [prompt_ids(n, 512, seed=20 + i)[0] for i, n in enumerate((300, 130, 90))]  # 300 > window
    packed, rows = run_packed(dflash_jax.load_target(path), docs, LAYER_IDS)
    for doc, sl in zip(docs, rows, strict=True):
        assert_matches_reference(packed, *hf_reference(hf_model, doc[None]), LAYER_IDS, rows=sl)


def test_router_equals_transformers_with_ties():
    """Router with bias, top-k of the logits, softmax over the k: ids and weights as transformers',
    ties inside the top k included (experts 2 = 3 share router row and bias)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    hf_model = make_gpt_oss(seed=1)
    router: GptOssTopKRouter = hf_model.model.layers[0].mlp.router
    with torch.no_grad():
        router.weight[3], router.bias[3] = router.weight[2], router.bias[2]
        x = torch.randn(500, 64)
        logits, ref_w, ref_i = router(x)
    top = np.sort(logits.numpy(), -1)[:, ::-1]
    straddle = top[:, 1] == top[:, 2]
    c = TargetConfig.from_hf_dict(hf_model.config.to_dict())
    p = {
        "router": jnp.asarray(router.weight.detach().numpy().T),
        "router_bias": jnp.asarray(router.bias.detach().numpy()),
    }
    ours_w, ours_i = (np.asarray(a) for a in route(jnp.asarray(x.numpy()), p, c))
    o = np.argsort(ours_i, -1)
    r = np.argsort(ref_i.numpy(), -1)
    ours_w, ours_i = np.take_along_axis(ours_w, o, -1), np.take_along_axis(ours_i, o, -1)
    ref_w, ref_i = np.take_along_axis(ref_w.numpy(), r, -1), np.take_along_axis(ref_i.numpy(), r, -1)
    both = [k for k in range(500) if {2, 3} <= set(ref_i[k])]
    assert len(both) > 5
    np.testing.assert_array_equal(ours_i[~straddle], ref_i[~straddle])
    np.testing.assert_allclose(ours_w, ref_w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_is_bit_exact(dtype):
    """Every byte (two FP4 nibbles) under every scale 0..255: ours == transformers'
    convert_moe_packed_tensors, bit for bit (2**128 overflows to inf in both)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = np.stack([np.roll(np.arange(256, dtype=np.uint8), s)[:256].reshape(16, 16) for s in range(256)])
    blocks = blocks.reshape(2, 128, 16, 16)  # [E, rows, G, 16]: every byte in every group
    scales = np.arange(256, dtype=np.uint8).repeat(16).reshape(2, 128, 16)
    rng.shuffle(scales.reshape(-1))
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    ours = torch.from_numpy(dequantize(blocks, scales)).to(dtype)
    assert ours.shape == ref.shape == (2, 16 * 32, 128)
    assert torch.isinf(ref).any() and not torch.isnan(ref).any()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ours.view(bits), ref.view(bits))


def test_mxfp4_checkpoint_loads_and_matches(tmp_path_factory, tmp_path):
    """A checkpoint with MXFP4-packed experts (as published: *_blocks + *_scales, quantization_config
    mxfp4) loads with no missing or unexpected key and runs as transformers does on the same
    dequantised weights; a missing scale is named."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, _ = checkpoint(tmp_path_factory, "gpt_oss")
    hf_model = make_gpt_oss(seed=0)
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(5)
    for i in range(4):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = quantize_mxfp4(tensors.pop(key), rng)
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            w = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            )
            with torch.no_grad():
                getattr(hf_model.model.layers[i].mlp.experts, name).copy_(w)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, packed / "model.safetensors", metadata={"format": "pt"})
    target = dflash_jax.load_target(packed)
    ids = prompt_ids(PROMPT_LEN, 512, seed=3)
    assert_matches_reference(run_target(target, ids, LAYER_IDS), *hf_reference(hf_model, ids), LAYER_IDS)
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, packed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.down_proj_scales"
    ):
        dflash_jax.load_target(packed)


def test_export_gives_back_the_checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file

    from convert.hf_target import export_target_state

    path, _ = checkpoint(tmp_path_factory, "gpt_oss")
    saved = load_file(path / "model.safetensors")
    assert_same_tensors(export_target_state(dflash_jax.load_target(path)), saved)


def test_expert_parallel_equals_single_device(tmp_path_factory):
    path, _ = checkpoint(tmp_path_factory, "gpt_oss")
    ids = prompt_ids(200, 512, seed=2, batch=4)
    single = run_target(dflash_jax.load_target(path), ids, LAYER_IDS)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    target = dflash_jax.load_target(path, mesh=mesh)
    assert target.moe.gate[...].addressable_shards[0].data.shape[1] == 1
    out = run_target(target, ids, LAYER_IDS, mesh=mesh)
    assert_same_outputs(out, single, atol=1e-5, rtol=1e-5)  # fp32 noise of reordered sums: ~5e-6 relative


def test_config_roundtrip():
    c = TargetConfig.from_hf_dict(make_gpt_oss().config.to_dict())
    assert TargetConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c
    with pytest.raises(ValueError, match="unsupported layer_types"):
        TargetConfig.from_hf_dict({**c.to_hf_dict(), "layer_types": ["chunked_attention"] * 4})
