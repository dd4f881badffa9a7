"""The Qwen3.5-MoE hybrid (Gated DeltaNet + gated attention, every MLP a MoE block with a
sigmoid-gated shared expert) vs transformers (fp32) on a tiny random config: both checkpoint
layouts (text-only, vision-language with its vision tower skipped), the fused expert layout,
packed documents, the cache with rollback, expert parallelism, and lossless speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hf_fixtures import prompt_ids
from moe_fixtures import make_qwen3_5_moe
from target_families import (
    FAMILIES,
    assert_matches_reference,
    assert_same_outputs,
    assert_same_tensors,
    biased_towards,
    checkpoint,
    hf_reference,
    layout_configs,
    ragged_prompts,
    run_packed,
    run_target,
)

import dflash_jax
from dflash_jax.sharding import MeshConfig, make_mesh

LAYER_IDS = FAMILIES["qwen3_5_moe"].layer_ids


def test_config_is_a_hybrid_with_a_shared_expert(tmp_path_factory):
    for c in layout_configs(tmp_path_factory, "qwen3_5_moe"):
        assert c.model_type == "qwen3_5_moe" and c.is_hybrid and c.shared_expert_intermediate_size == 48


def test_packed_documents_equal_each_alone(tmp_path_factory):
    path, hf_model = checkpoint(tmp_path_factory, "qwen3_5_moe", "text")
    docs = [prompt_ids(n, 512, seed=30 + i)[0] for i, n in enumerate((230, 170, 120))]
    packed, rows = run_packed(dflash_jax.load_target(path), docs, LAYER_IDS)
    for doc, sl in zip(docs, rows, strict=True):
        assert_matches_reference(packed, *hf_reference(hf_model, doc[None]), LAYER_IDS, rows=sl)


def test_cache_continuation_and_rollback(tmp_path_factory):
    path, _ = checkpoint(tmp_path_factory, "qwen3_5_moe", "text")
    target = dflash_jax.load_target(path)
    ids = jnp.asarray(prompt_ids(90, 512, seed=4), jnp.int32)
    full = run_target(target, ids, LAYER_IDS)
    step = nnx.jit(lambda m, x, c: m(x, cache=c))
    o1 = step(target, ids[:, :70], target.init_cache(1, 128))
    o2 = step(target, ids[:, 70:86], o1.cache.commit())
    np.testing.assert_allclose(np.asarray(o2.logits), np.asarray(full.logits[:, 70:86]), atol=1e-4, rtol=0)
    back = jax.jit(lambda c, n: c.with_lengths(n))(o2.cache, jnp.asarray([75]))
    o3 = step(target, ids[:, 75:90], back)
    np.testing.assert_allclose(np.asarray(o3.logits), np.asarray(full.logits[:, 75:90]), atol=1e-4, rtol=0)


def test_expert_parallel_equals_single_device(tmp_path_factory):
    path, _ = checkpoint(tmp_path_factory, "qwen3_5_moe", "text")
    ids = prompt_ids(128, 512, seed=2, batch=4)
    single = run_target(dflash_jax.load_target(path), ids, LAYER_IDS)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    target = dflash_jax.load_target(path, mesh=mesh)
    assert target.moe.gate[...].addressable_shards[0].data.shape[1] == 2
    assert_same_outputs(run_target(target, ids, LAYER_IDS, mesh=mesh), single, atol=1e-5)


def test_export_gives_back_the_checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file

    from convert.hf_target import export_target_state

    path, _ = checkpoint(tmp_path_factory, "qwen3_5_moe", "text")
    saved = load_file(path / "model.safetensors")
    assert_same_tensors(export_target_state(dflash_jax.load_target(path)), saved)


def test_speculative_equals_greedy(tmp_path_factory):
    """Lossless speculative decoding on the hybrid MoE target (DeltaNet rollback inside blocks)."""
    from collections import Counter

    from dflash_jax.decoding.generate import generate
    from dflash_jax.decoding.speculative import speculative_generate
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.drafter.config import DrafterConfig

    C = 7
    hf = make_qwen3_5_moe("text", seed=2)
    prompts = ragged_prompts((24, 9, 30), seed=3)
    biased_towards(hf, prompts, C, alpha=2.0)
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
