"""Mixture-of-experts targets vs transformers (PyTorch, CPU, fp32) on tiny random configs: Qwen3-MoE
in both expert layouts (per-expert tensors as published, transformers 5's fused ones), with a
dense layer among the MoE ones (mlp_only_layers); routing incl. ties; packed documents; expert
parallelism on 8 simulated devices; strict key accounting; the planner's expert-axis check."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import prompt_ids
from moe_fixtures import TINY_QWEN3_MOE
from target_families import (
    FAMILIES,
    assert_matches_reference,
    assert_same_outputs,
    assert_same_tensors,
    checkpoint,
    hf_reference,
    layout_configs,
    rewrite_safetensors,
    run_packed,
    run_target,
)

import dflash_jax
from dflash_jax.sharding import MeshConfig, make_mesh
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.moe import route

LAYER_IDS = FAMILIES["qwen3_moe"].layer_ids


def test_config_names_the_moe_and_dense_layers(tmp_path_factory):
    for c in layout_configs(tmp_path_factory, "qwen3_moe"):
        assert c.model_type == "qwen3_moe" and c.moe_layers == (0, 2, 3) and c.norm_topk_prob


def test_packed_documents_equal_each_alone(tmp_path_factory):
    """Three documents in one 520-token row (segment_ids, positions restarting): each equals
    transformers on that document alone (routing is per token, attention per document)."""
    path, hf_model = checkpoint(tmp_path_factory, "qwen3_moe", "per_expert")
    docs = [prompt_ids(n, 512, seed=10 + i)[0] for i, n in enumerate((200, 170, 150))]
    packed, rows = run_packed(dflash_jax.load_target(path), docs, LAYER_IDS)
    for doc, sl in zip(docs, rows, strict=True):
        assert_matches_reference(packed, *hf_reference(hf_model, doc[None]), LAYER_IDS, rows=sl)


def _by_expert(weights, ids):
    """(weights, ids) [M, k] sorted by expert id within each row (the MoE output is a sum over the
    k choices, so their order is immaterial)."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(weights, order, -1), np.take_along_axis(ids, order, -1)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_equals_transformers_router_with_ties(norm_topk_prob):
    """The chosen experts and their weights equal transformers' router on the same inputs,
    including exact ties inside the top k (duplicated router rows: experts 2 = 3 and 5 = 6 score
    alike, and are often chosen together). Where a tie straddles the k-th place (one of a tied
    pair chosen; all-zero input, where every expert ties), torch.topk's pick is
    implementation-defined (libstdc++ introselect on CPU, another on CUDA): ours is always the
    lowest tied ids (lax.top_k), with the same weights."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf_cfg = transformers.Qwen3MoeConfig(**{**TINY_QWEN3_MOE, "norm_topk_prob": norm_topk_prob})
    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(hf_cfg)
    with torch.no_grad():
        w = torch.randn(8, 64)
        w[3], w[6] = w[2], w[5]
        router.weight.copy_(w)
    x = torch.randn(600, 64)
    x[:7] = 0.0
    with torch.no_grad():
        logits, ref_w, ref_i = router(x)
    probs = np.sort(torch.softmax(logits, -1).numpy(), -1)[:, ::-1]
    straddle = probs[:, 1] == probs[:, 2]  # k = 2: the 2nd and 3rd scores tie
    c = TargetConfig.from_hf_dict(hf_cfg.to_dict())
    ours_w, ours_i = route(jnp.asarray(x.numpy()), {"router": jnp.asarray(w.numpy().T)}, c)
    ours_w, ours_i = _by_expert(np.asarray(ours_w), np.asarray(ours_i))
    ref_w, ref_i = _by_expert(ref_w.numpy(), ref_i.numpy())
    inside = [
        r for r in range(600) if not straddle[r] and ({2, 3} <= set(ref_i[r]) or {5, 6} <= set(ref_i[r]))
    ]
    assert len(inside) > 20 and 7 < straddle.sum() < 300
    np.testing.assert_array_equal(ours_i[~straddle], ref_i[~straddle])
    np.testing.assert_allclose(ours_w, ref_w, atol=1e-5, rtol=0)  # tied experts have equal weights
    assert (ours_i[:7] == [0, 1]).all()
    for r in np.flatnonzero(straddle[7:]) + 7:  # the lower of the tied pair
        assert set(ours_i[r]) - set(ref_i[r]) <= {2, 5} and set(ref_i[r]) - set(ours_i[r]) <= {3, 6}


@pytest.mark.parametrize(
    "layout",
    [MeshConfig(data=2, fsdp=2, tensor=2), MeshConfig(data=1, fsdp=8, tensor=1)],
    ids=["d2f2t2", "f8"],
)
def test_expert_parallel_equals_single_device(layout, tmp_path_factory):
    """Experts split over fsdp x tensor (d2f2t2: 2 experts per device, tokens gathered over fsdp,
    summed over tensor; f8: one expert per device, 4 rows on 8 fsdp devices so the tokens are
    replicated and the partial outputs summed): == one device within 1e-5."""
    path, _ = checkpoint(tmp_path_factory, "qwen3_moe", "per_expert")
    ids = prompt_ids(256, 512, seed=2, batch=4)
    single = run_target(dflash_jax.load_target(path), ids, LAYER_IDS)
    mesh = make_mesh(layout)
    target = dflash_jax.load_target(path, mesh=mesh)
    gate = target.moe.gate[...]
    assert gate.sharding.spec[1] is not None and len(gate.sharding.device_set) == 8
    assert gate.addressable_shards[0].data.shape[1] == 8 // (layout.fsdp * layout.tensor)
    out = run_target(target, ids, LAYER_IDS, mesh=mesh)
    assert_same_outputs(out, single, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.expert_load), np.asarray(single.expert_load))


def test_strict_key_accounting(tmp_path_factory, tmp_path):
    per, _ = checkpoint(tmp_path_factory, "qwen3_moe", "per_expert")
    fused, _ = checkpoint(tmp_path_factory, "qwen3_moe", "fused")
    bad = rewrite_safetensors(
        per, tmp_path / "a", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    )
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    ):
        dflash_jax.load_target(bad)
    bad = rewrite_safetensors(
        per, tmp_path / "b", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")
    )  # dense layer
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.weight"):
        dflash_jax.load_target(bad)
    # An expert tensor on the dense layer is unexpected; a fused tensor of the wrong width is named.
    bad = rewrite_safetensors(
        per,
        tmp_path / "c",
        lambda t: t.__setitem__(
            "model.layers.1.mlp.experts.0.up_proj.weight", np.zeros((32, 64), np.float32)
        ),
    )
    with pytest.raises(
        ValueError, match=r"unexpected tensors: model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight"
    ):
        dflash_jax.load_target(bad)
    bad = rewrite_safetensors(
        fused,
        tmp_path / "d",
        lambda t: t.__setitem__("model.layers.0.mlp.experts.gate_up_proj", np.zeros((8, 32, 64), np.float32)),
    )
    with pytest.raises(ValueError, match=r"gate_up_proj.*shape \(8, 32, 64\), expected \(8, 64, 64\)"):
        dflash_jax.load_target(bad)


def test_export_gives_back_both_layouts(tmp_path_factory):
    from safetensors.numpy import load_file

    from convert.hf_target import export_target_state

    path, hf_model = checkpoint(tmp_path_factory, "qwen3_moe", "per_expert")
    target = dflash_jax.load_target(path)
    assert_same_tensors(export_target_state(target), load_file(path / "model.safetensors"))
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert_same_tensors(export_target_state(target, layout="fused"), state)


def test_config_sparse_step_and_roundtrip():
    hf = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]}  # fmt: skip
    c = TargetConfig.from_hf_dict(hf)
    assert c.moe_layers == (1, 5) and c.dense_mlp_layers == (0, 2, 3, 4)
    assert TargetConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c
    with pytest.raises(ValueError, match="num_experts_per_tok=9 <= num_experts=8"):
        TargetConfig.from_hf_dict({**hf, "num_experts_per_tok": 9})


def test_planner_names_experts_and_axis():
    """A layout whose fsdp x tensor does not divide the expert count fails naming both numbers."""
    from types import SimpleNamespace

    from dflash_jax.tools.plan import LayoutError, PlanSpec, check_layout

    c = TargetConfig.from_hf_dict({**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "num_experts": 6})
    drafter = SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=96)
    spec = PlanSpec(target_config=c, drafter_config=drafter, train_section=None, batch_rows=8)
    assert check_layout(MeshConfig(data=4, fsdp=2, tensor=1), spec, 8) == (4, 2, 1)  # 2 divides 6
    with pytest.raises(LayoutError, match=r"fsdp\*tensor=4 does not divide num_experts \(target\)=6"):
        check_layout(MeshConfig(data=2, fsdp=2, tensor=2), spec, 8)
