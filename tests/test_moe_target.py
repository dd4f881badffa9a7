"""Mixture-of-experts targets vs transformers (PyTorch, CPU, fp32) on tiny random configs: Qwen3-MoE
in both expert layouts (per-expert tensors as published, transformers 5's fused ones), with a
dense layer among the MoE ones (mlp_only_layers); routing incl. ties; packed documents; expert
parallelism on 8 simulated devices; strict key accounting; the planner's expert-axis check."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import prompt_ids
from moe_fixtures import TINY_QWEN3_MOE, make_qwen3_moe, save_fused

import dflash_jax
from dflash_jax.sharding import MeshConfig, make_mesh
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.moe import route

LAYER_IDS = (3, 0, 1)  # 3: the last layer (MoE), 0: MoE, 1: the dense-MLP layer
PROMPT_LEN = 520
_CKPT: dict = {}


def checkpoint(layout, tmp_path_factory):
    """One HF model, saved in the requested expert layout."""
    if "model" not in _CKPT:
        _CKPT["model"] = make_qwen3_moe(seed=0)
    if layout not in _CKPT:
        d = tmp_path_factory.mktemp(f"qwen3_moe_{layout}")
        if layout == "per_expert":
            _CKPT["model"].save_pretrained(d)  # what transformers writes and the hub holds
        else:
            save_fused(_CKPT["model"], d)
        _CKPT[layout] = d
    return _CKPT[layout], _CKPT["model"]


def hf_reference(model, ids):
    raw = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: raw.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out).numpy()
            )
        )
        for i, layer in enumerate(model.model.layers)
    ]
    for i, layer in enumerate(model.model.layers):  # the router's top-k expert ids per MoE layer
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None and hasattr(router, "top_k"):
            hooks.append(router.register_forward_hook(
                lambda mod, args, out, i=i: raw.__setitem__(f"router{i}", out[2].numpy())
            ))  # fmt: skip
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    for h in hooks:
        h.remove()
    return out, raw


def run(target, ids, layer_ids=LAYER_IDS, mesh=None, **kw):
    fn = nnx.jit(lambda m, x: m(x, layer_ids=layer_ids, **kw))
    if mesh is None:
        return fn(target, jnp.asarray(ids, jnp.int32))
    with jax.set_mesh(mesh):
        return fn(target, jnp.asarray(ids, jnp.int32))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_parity_with_transformers(layout, tmp_path_factory):
    path, hf_model = checkpoint(layout, tmp_path_factory)
    ids = prompt_ids(PROMPT_LEN, 512, seed=1)
    ref, raw = hf_reference(hf_model, ids)
    target = dflash_jax.load_target(path)
    c = target.config
    assert c.model_type == "qwen3_moe" and c.moe_layers == (0, 2, 3) and c.norm_topk_prob
    out = run(target, ids)
    H = c.hidden_size
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out.hidden), ref.hidden_states[-1].numpy(), atol=1e-4, rtol=0)
    for j, layer in enumerate(LAYER_IDS):
        np.testing.assert_allclose(
            np.asarray(out.features[..., j * H : (j + 1) * H]),
            raw[layer],
            atol=1e-4,
            rtol=0,
            err_msg=f"layer {layer}",
        )
    # The router load, one row per MoE layer: the counts of transformers' own top-k choices.
    load = np.asarray(out.expert_load)
    assert load.shape == (3, c.num_experts)
    for row, layer in enumerate(c.moe_layers):
        want = np.bincount(raw[f"router{layer}"].reshape(-1), minlength=c.num_experts)
        np.testing.assert_array_equal(load[row], want, err_msg=f"load of layer {layer}")


def test_packed_documents_equal_each_alone(tmp_path_factory):
    """Three documents in one 520-token row (segment_ids, positions restarting): each equals
    transformers on that document alone (routing is per token, attention per document)."""
    path, hf_model = checkpoint("per_expert", tmp_path_factory)
    target = dflash_jax.load_target(path)
    lens = (200, 170, 150)
    docs = [prompt_ids(n, 512, seed=10 + i)[0] for i, n in enumerate(lens)]
    ids = np.concatenate(docs)[None]
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)]).astype(np.int32)[None]
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)[None]
    fn = nnx.jit(lambda m, x, p, s: m(x, p, layer_ids=LAYER_IDS, segment_ids=s))
    packed = fn(target, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seg))
    H, start = target.config.hidden_size, 0
    for doc in docs:
        sl = slice(start, start + len(doc))
        start += len(doc)
        ref, raw = hf_reference(hf_model, doc[None])
        np.testing.assert_allclose(np.asarray(packed.logits[:, sl]), ref.logits.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(
            np.asarray(packed.hidden[:, sl]), ref.hidden_states[-1].numpy(), atol=1e-4, rtol=0
        )
        for j, layer in enumerate(LAYER_IDS):
            np.testing.assert_allclose(
                np.asarray(packed.features[:, sl, j * H : (j + 1) * H]), raw[layer], atol=1e-4, rtol=0
            )


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
    path, _ = checkpoint("per_expert", tmp_path_factory)
    ids = prompt_ids(256, 512, seed=2, batch=4)
    single = run(dflash_jax.load_target(path), ids)
    mesh = make_mesh(layout)
    target = dflash_jax.load_target(path, mesh=mesh)
    gate = target.moe.gate[...]
    assert gate.sharding.spec[1] is not None and len(gate.sharding.device_set) == 8
    assert gate.addressable_shards[0].data.shape[1] == 8 // (layout.fsdp * layout.tensor)
    out = run(target, ids, mesh=mesh)
    for name in ("logits", "hidden", "features"):
        np.testing.assert_allclose(
            np.asarray(getattr(out, name)), np.asarray(getattr(single, name)), atol=1e-5, rtol=0, err_msg=name
        )
    np.testing.assert_array_equal(np.asarray(out.expert_load), np.asarray(single.expert_load))


def _rewrite(src, dst, edit):
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_strict_key_accounting(tmp_path_factory, tmp_path):
    per, _ = checkpoint("per_expert", tmp_path_factory)
    fused, _ = checkpoint("fused", tmp_path_factory)
    bad = _rewrite(per, tmp_path / "a", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    ):
        dflash_jax.load_target(bad)
    bad = _rewrite(per, tmp_path / "b", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))  # dense layer
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.weight"):
        dflash_jax.load_target(bad)
    # An expert tensor on the dense layer is unexpected; a fused tensor of the wrong width is named.
    bad = _rewrite(
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
    bad = _rewrite(
        fused,
        tmp_path / "d",
        lambda t: t.__setitem__("model.layers.0.mlp.experts.gate_up_proj", np.zeros((8, 32, 64), np.float32)),
    )
    with pytest.raises(ValueError, match=r"gate_up_proj.*shape \(8, 32, 64\), expected \(8, 64, 64\)"):
        dflash_jax.load_target(bad)


def test_export_gives_back_both_layouts(tmp_path_factory):
    from safetensors.numpy import load_file

    from convert.hf_target import export_target_state

    path, hf_model = checkpoint("per_expert", tmp_path_factory)
    target = dflash_jax.load_target(path)
    saved = load_file(path / "model.safetensors")
    exported = export_target_state(target)
    assert set(exported) == set(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    fused = export_target_state(target, layout="fused")
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert set(fused) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(fused[key], value, err_msg=key)


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
