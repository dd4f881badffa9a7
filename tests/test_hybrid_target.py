"""The Qwen3.5 hybrid target on tiny random configs: both checkpoint layouts' configs, strict key
accounting, packed documents, the cache and its rollback, export (its parity with transformers on a
long prompt, in both layouts: test_target_parity.py)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import prompt_ids
from target_families import FAMILIES, assert_same_tensors, checkpoint, run_packed, run_target

import dflash_jax
from dflash_jax.target.config import TargetConfig

LAYER_IDS = FAMILIES["qwen3_5"].layer_ids


def test_config_both_layouts_agree(tmp_path_factory):
    text = TargetConfig.from_pretrained(checkpoint(tmp_path_factory, "qwen3_5", "text")[0])
    assert text.model_type == "qwen3_5"
    vl = TargetConfig.from_pretrained(checkpoint(tmp_path_factory, "qwen3_5", "vl")[0])
    assert text == vl
    assert text.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert text.rotary_dim == 8 and text.qk_norm


def test_unknown_or_missing_tensors_are_named(tmp_path_factory, tmp_path):
    """Strict accounting: visual/mtp tensors are skipped by rule, anything else unexpected fails."""
    from safetensors.numpy import load_file, save_file

    src, _ = checkpoint(tmp_path_factory, "qwen3_5", "vl")
    tensors = load_file(src / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in tensors)
    tensors["mtp.layers.0.mlp.up_proj.weight"] = np.zeros((4, 4), np.float32)  # skipped by rule
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    dflash_jax.load_target(tmp_path)  # loads
    tensors["model.language_model.layers.0.linear_attn.extra.weight"] = np.zeros((2,), np.float32)
    del tensors["model.language_model.layers.1.linear_attn.A_log"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.language_model\.layers\.1\.linear_attn\.A_log"
    ):
        dflash_jax.load_target(tmp_path)


def test_packed_documents_equal_each_alone(tmp_path_factory):
    """Two documents in one row (segment_ids, positions restarting): the recurrent state, the conv
    window and attention all restart at the boundary."""
    path, _ = checkpoint(tmp_path_factory, "qwen3_5", "text")
    target = dflash_jax.load_target(path)
    docs = [prompt_ids(150, 512, seed=2)[0], prompt_ids(107, 512, seed=3)[0]]
    packed, rows = run_packed(target, docs, LAYER_IDS, first_segment=0)
    for doc, sl in zip(docs, rows, strict=True):
        alone = run_target(target, doc[None], LAYER_IDS)
        np.testing.assert_allclose(
            np.asarray(packed.logits[:, sl]), np.asarray(alone.logits), atol=1e-4, rtol=0
        )
        np.testing.assert_allclose(
            np.asarray(packed.features[:, sl]), np.asarray(alone.features), atol=1e-4, rtol=0
        )


def test_cache_continuation_and_rollback(tmp_path_factory):
    """Prefill + a block on the cache == one forward over everything; cropping the block's cache
    back to k tokens and continuing == having run only those k."""
    path, _ = checkpoint(tmp_path_factory, "qwen3_5", "text")
    target = dflash_jax.load_target(path)
    ids = jnp.asarray(prompt_ids(90, 512, seed=4), jnp.int32)
    full = run_target(target, ids, LAYER_IDS)
    step = nnx.jit(lambda m, x, c: m(x, cache=c))
    cache = target.init_cache(1, 128)
    o1 = step(target, ids[:, :70], cache)
    o2 = step(target, ids[:, 70:86], o1.cache.commit())
    np.testing.assert_allclose(np.asarray(o2.logits), np.asarray(full.logits[:, 70:86]), atol=1e-4, rtol=0)
    # Roll back the 16-token block to its first 5 tokens, then feed tokens 75.. again.
    crop = jax.jit(lambda c, n: c.with_lengths(n))
    back = crop(o2.cache, jnp.asarray([75]))
    o3 = step(target, ids[:, 75:90], back)
    np.testing.assert_allclose(np.asarray(o3.logits), np.asarray(full.logits[:, 75:90]), atol=1e-4, rtol=0)
    # Right-padded prefill cropped to the true length (what generation does with ragged prompts).
    padded = jnp.concatenate([ids[:, :60], jnp.zeros((1, 4), jnp.int32)], axis=1)
    o4 = step(target, padded, cache)
    o5 = step(target, ids[:, 60:75], crop(o4.cache, jnp.asarray([60])))
    np.testing.assert_allclose(np.asarray(o5.logits), np.asarray(full.logits[:, 60:75]), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="rollback data"):
        o2.cache.commit().with_lengths(jnp.asarray([80]))


def test_config_json_roundtrip():
    c = TargetConfig.from_hf_dict(
        json.loads(
            json.dumps(
                TargetConfig.from_hf_dict(
                    {
                        "model_type": "qwen3_5_text",
                        "vocab_size": 512,
                        "hidden_size": 64,
                        "intermediate_size": 112,
                        "num_hidden_layers": 8,
                        "num_attention_heads": 4,
                        "num_key_value_heads": 2,
                        "head_dim": 32,
                        "linear_num_key_heads": 2,
                        "linear_num_value_heads": 4,
                        "linear_key_head_dim": 16,
                        "linear_value_head_dim": 16,
                        "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
                    }
                ).to_hf_dict()
            )
        )
    )
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",
    )
    assert c.rotary_dim == 8 and c.rope.theta == 1e7
    with pytest.raises(ValueError, match="qwen3_next"):
        TargetConfig.from_hf_dict({"model_type": "qwen3_next"})


def test_export_gives_back_the_hf_tensors(tmp_path_factory):
    """Load then export (``convert.hf_target.export_target_state``) returns every HF tensor of the
    text checkpoint unchanged: the fused q|k|v channels we regroup by key head go back in HF order."""
    from convert.hf_target import export_target_state

    path, hf_model = checkpoint(tmp_path_factory, "qwen3_5", "text")
    reference = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert_same_tensors(export_target_state(dflash_jax.load_target(path)), reference)
