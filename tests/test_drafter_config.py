"""DrafterConfig: defaults from the target, validation, our dict and z-lab's HF dict."""

from __future__ import annotations

import types

import pytest
from fixtures import stub_target_config

from dflash_jax.drafter.config import DrafterConfig, build_target_layer_ids
from dflash_jax.layers import RopeConfig

TARGET = stub_target_config()


def make(**kw):
    base = dict(num_layers=5, mask_token_id=999)
    base.update(kw)
    return DrafterConfig.for_target(TARGET, **base)


def test_default_target_layer_ids_follow_zlab():
    dflash_model = pytest.importorskip("dflash.model")
    assert build_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    for n_target in range(4, 81):
        for n_draft in range(1, 9):
            assert list(build_target_layer_ids(n_target, n_draft)) == dflash_model.build_target_layer_ids(
                n_target, n_draft
            ), (n_target, n_draft)


def test_for_target_takes_the_targets_shape():
    cfg = make()
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 4, 16)
    assert cfg.rope == RopeConfig(theta=1e6) and cfg.rms_norm_eps == 1e-5
    assert cfg.feature_size == 5 * 64 and cfg.block_size == 16
    assert cfg.layer_types == ("full_attention",) * 5
    assert not any(cfg.layer_causal(i) for i in range(5))
    cfg.check_target(TARGET)
    assert make(num_layers=1).target_layer_ids == (18,)
    assert make(target_layer_ids=[2, 7]).target_layer_ids == (2, 7)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(target_layer_ids=(1, 36)), "not a layer of a 36-layer target"),
        (dict(target_layer_ids=(3, 3)), "repeats a layer"),
        (dict(target_layer_ids=()), "must not be empty"),
        (dict(num_kv_heads=3), "not a multiple of num_kv_heads"),
        (dict(mask_token_id=1000), "outside the vocabulary"),
        (dict(block_size=1), "block_size"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(layer_types=("full_attention",)), "layer_types has 1 entries"),
        (dict(layer_types=("full_attention",) * 4 + ("sliding_attention",)), "sliding_window is None"),
        (dict(layer_types=("full_attention",) * 4 + ("local",)), "unknown 'local'"),
        (dict(attention_impl="flash"), "attention_impl"),
        (dict(compute_dtype="float64"), "compute_dtype"),
        (dict(num_layers=0), "num_layers"),
        (dict(bogus=1), r"unknown keys \['bogus'\]"),
    ],
)
def test_validation_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_check_target_mismatch():
    cfg = make()
    with pytest.raises(ValueError, match="hidden_size=64 does not match the target's hidden_size=32"):
        cfg.check_target(types.SimpleNamespace(**{**vars(TARGET), "hidden_size": 32}))
    with pytest.raises(ValueError, match="target_num_layers=36"):
        cfg.check_target(types.SimpleNamespace(**{**vars(TARGET), "num_layers": 28}))


def test_our_dict_round_trip_and_unknown_keys():
    cfg = make(
        layer_types=("full_attention",) * 4 + ("sliding_attention",),
        sliding_window=128,
        causal_in_block=False,
        compute_dtype="bfloat16",
        logit_softcap=30.0,
    )
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        DrafterConfig.from_dict({**cfg.to_dict(), "extra": 1})


def test_hf_dict_round_trip_and_qwen3config_semantics():
    transformers = pytest.importorskip("transformers")
    cfg = make(
        layer_types=("full_attention",) * 3 + ("sliding_attention",) * 2,
        sliding_window=256,
        embedding_scale=2.0,
        rope=RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, original_max_position_embeddings=4096),
    )
    hf = cfg.to_hf_dict(dtype="bfloat16")
    assert hf["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert hf["dflash_config"]["mask_token_id"] == 999 and hf["block_size"] == 16
    assert hf["num_target_layers"] == 36 and hf["architectures"] == ["DFlashDraftModel"]
    assert DrafterConfig.from_hf_dict(hf) == cfg
    # transformers reads the same layer types / window / rope back.
    q = transformers.Qwen3Config(**hf)
    assert list(q.layer_types) == list(cfg.layer_types) and q.sliding_window == 256
    assert DrafterConfig.from_hf_dict(q.to_dict()) == cfg
    # our-only fields come in as overrides
    assert DrafterConfig.from_hf_dict(hf, attention_impl="reference").attention_impl == "reference"


def test_hf_dict_zlab_layout_and_rejections():
    hf = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 1000,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "num_target_layers": 36,
        "block_size": 10,
        "dflash_config": {"mask_token_id": 7},
        "use_sliding_window": False,
        "sliding_window": 4096,
        "transformers_version": "4.57.1",
    }
    cfg = DrafterConfig.from_hf_dict(hf)
    assert cfg.target_layer_ids == (1, 33)  # z-lab's default for 2 draft layers
    assert cfg.block_size == 10 and cfg.mask_token_id == 7 and cfg.rope.theta == 1e6
    assert cfg.sliding_window is None and cfg.layer_types == ("full_attention",) * 2
    assert (
        DrafterConfig.from_hf_dict({**hf, "dflash_config": {"mask_token_id": 7, "block_size": 4}}).block_size
        == 4
    )
    for bad, match in [
        ({"dflash_config": {"mask_token_id": 7, "projector_type": "domino"}}, "projector_type"),
        ({"conv_kernel_size": 4}, "unsupported drafter variant"),
        ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"dflash_config": {}}, "mask_token_id"),
    ]:
        with pytest.raises(ValueError, match=match):
            DrafterConfig.from_hf_dict({**hf, **bad})
