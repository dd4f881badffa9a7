"""The Qwen3.5-MoE hybrid (Gated DeltaNet + gated attention, every MLP a MoE block with a
sigmoid-gated shared expert) vs transformers (fp32) on a tiny random config: both checkpoint
layouts (text-only, vision-language with its vision tower skipped), the fused expert layout,
packed documents, the cache with rollback, expert parallelism, and lossless speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import prompt_ids
from hybrid_fixtures import text_model
from moe_fixtures import make_qwen3_5_moe, save_fused

import dflash_jax
from dflash_jax.sharding import MeshConfig, make_mesh

LAYER_IDS = (5, 0, 2)  # 5: last (full attention), 0: linear attention, 2: full; all MoE
PROMPT_LEN = 520
_CKPT: dict = {}


def checkpoint(layout, tmp_path_factory):
    if layout not in _CKPT:
        d = tmp_path_factory.mktemp(f"qwen3_5_moe_{layout}")
        model = make_qwen3_5_moe("text" if layout == "fused" else layout, seed=0 if layout != "vl" else 1)
        if layout == "fused":
            save_fused(model, d)
        else:
            model.save_pretrained(d)
        _CKPT[layout] = (d, model)
    return _CKPT[layout]


def hf_reference(model, ids):
    raw = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: raw.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out).numpy()
            )
        )
        for i, layer in enumerate(text_model(model).layers)
    ]
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    for h in hooks:
        h.remove()
    return out, raw


def run(target, ids, layer_ids=LAYER_IDS, mesh=None):
    fn = nnx.jit(lambda m, x: m(x, layer_ids=layer_ids))
    if mesh is None:
        return fn(target, jnp.asarray(ids, jnp.int32))
    with jax.set_mesh(mesh):
        return fn(target, jnp.asarray(ids, jnp.int32))


@pytest.mark.parametrize("layout", ["text", "vl", "fused"])
def test_parity_with_transformers(layout, tmp_path_factory):
    path, hf_model = checkpoint(layout, tmp_path_factory)
    ids = prompt_ids(PROMPT_LEN, 512, seed=1)
    ref, raw = hf_reference(hf_model, ids)
    target = dflash_jax.load_target(path)
    c = target.config
    assert c.model_type == "qwen3_5_moe" and c.is_hybrid and c.shared_expert_intermediate_size == 48
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
    load = np.asarray(out.expert_load)
    assert load.shape == (6, 8) and (load.sum(1) == PROMPT_LEN * 2).all()


def test_packed_documents_equal_each_alone(tmp_path_factory):
    path, hf_model = checkpoint("text", tmp_path_factory)
    target = dflash_jax.load_target(path)
    lens = (230, 170, 120)
    docs = [prompt_ids(n, 512, seed=30 + i)[0] for i, n in enumerate(lens)]
    ids = np.concatenate(docs)[None]
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)]).astype(np.int32)[None]
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)[None]
    fn = nnx.jit(lambda m, x, p, s: m(x, p, layer_ids=LAYER_IDS, segment_ids=s))
    packed = fn(target, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seg))
    start = 0
    for doc in docs:
        sl = slice(start, start + len(doc))
        start += len(doc)
        ref, _ = hf_reference(hf_model, doc[None])
        np.testing.assert_allclose(np.asarray(packed.logits[:, sl]), ref.logits.numpy(), atol=1e-4, rtol=0)


def test_cache_continuation_and_rollback(tmp_path_factory):
    path, _ = checkpoint("text", tmp_path_factory)
    target = dflash_jax.load_target(path)
    ids = jnp.asarray(prompt_ids(90, 512, seed=4), jnp.int32)
    full = run(target, ids)
    step = nnx.jit(lambda m, x, c: m(x, cache=c))
    o1 = step(target, ids[:, :70], target.init_cache(1, 128))
    o2 = step(target, ids[:, 70:86], o1.cache.commit())
    np.testing.assert_allclose(np.asarray(o2.logits), np.asarray(full.logits[:, 70:86]), atol=1e-4, rtol=0)
    back = jax.jit(lambda c, n: c.with_lengths(n))(o2.cache, jnp.asarray([75]))
    o3 = step(target, ids[:, 75:90], back)
    np.testing.assert_allclose(np.asarray(o3.logits), np.asarray(full.logits[:, 75:90]), atol=1e-4, rtol=0)


def test_expert_parallel_equals_single_device(tmp_path_factory):
    path, _ = checkpoint("text", tmp_path_factory)
    ids = prompt_ids(128, 512, seed=2, batch=4)
    single = run(dflash_jax.load_target(path), ids)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    target = dflash_jax.load_target(path, mesh=mesh)
    assert target.moe.gate[...].addressable_shards[0].data.shape[1] == 2
    out = run(target, ids, mesh=mesh)
    for name in ("logits", "hidden", "features"):
        np.testing.assert_allclose(
            np.asarray(getattr(out, name)), np.asarray(getattr(single, name)), atol=1e-5, rtol=0, err_msg=name
        )


def test_export_gives_back_the_checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file

    from convert.hf_target import export_target_state

    path, _ = checkpoint("text", tmp_path_factory)
    saved = load_file(path / "model.safetensors")
    exported = export_target_state(dflash_jax.load_target(path))
    assert set(exported) == set(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_speculative_equals_greedy(tmp_path_factory):
    """Lossless speculative decoding on the hybrid MoE target (DeltaNet rollback inside blocks)."""
    from collections import Counter

    from dflash_jax.decoding.generate import generate
    from dflash_jax.decoding.speculative import speculative_generate
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.drafter.config import DrafterConfig

    C = 7
    hf = make_qwen3_5_moe("text", seed=2)
    rows = prompt_ids(30, 512, seed=3, batch=3)
    prompts = [rows[i, :n].tolist() for i, n in enumerate((24, 9, 30))]
    with torch.no_grad():
        hs = torch.cat(
            [hf(torch.tensor(p)[None], output_hidden_states=True).hidden_states[-1][0] for p in prompts]
        )
        w = hf.lm_head.weight
        w[C] = 2.0 * hs.mean(0) / hs.mean(0).norm() * w.norm(dim=1).mean()
    d = tmp_path_factory.mktemp("q35moe_biased")
    hf.save_pretrained(d)
    target = dflash_jax.load_target(d)
    cfg = DrafterConfig.for_target(
        target.config,
        num_layers=1,
        mask_token_id=C,
        block_size=4,
        target_layer_ids=(0, 2, 5),
        intermediate_size=96,
    )
    drafter = init_drafter(cfg, target, 7)
    plain = generate(target, prompts, max_new_tokens=16, batch_size=2)
    ours = speculative_generate(target, drafter, prompts, max_new_tokens=16, block_size=4, batch_size=2)
    assert [o.output_ids for o in ours] == plain
    # Every verify step keeps fewer tokens than it wrote (acceptance < block), so each one rolls
    # the DeltaNet state and conv window back inside the verified block.
    steps = Counter(a for o in ours for a in o.acceptance_lengths)
    assert sum(steps.values()) > 10 and max(steps) < 4, steps
