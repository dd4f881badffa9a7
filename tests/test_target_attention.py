"""The target's tiled attention: values against the dense formulation and HF, and memory in T."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import tiny_target_config
from flax import nnx

from dflash_jax.target import attention
from dflash_jax.target.attention import (
    attend_reference,
    attend_xla,
    cache_attention_mask,
    self_attention_mask,
)
from dflash_jax.target.model import TargetModel


def _qkv(B, T, S, N, K, H, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, T, N, H), dtype),
        jax.random.normal(kk, (B, S, K, H), dtype),
        jax.random.normal(kv, (B, S, K, H), dtype),
    )


def _packed_segments(B, T, rng):
    """Rows of several documents of random lengths, a padded (segment 0) tail on some rows."""
    rows = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), size=3, replace=False))
        seg = np.zeros(T, np.int32)
        for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, T], strict=True)):
            seg[a:b] = i + 1
        seg[cuts[-1] :] = 0 if rng.random() < 0.5 else seg[cuts[-1]]
        rows.append(seg)
    return jnp.asarray(np.stack(rows))


@pytest.mark.parametrize("q_tile,kv_tile", [(16, 16), (32, 8), (8, 48), (512, 512)])
def test_tiled_matches_dense_on_packed_documents(q_tile, kv_tile):
    B, T, N, K, H = 2, 75, 4, 2, 8  # T not a multiple of any tile: padding on both sides
    q, k, v = _qkv(B, T, T, N, K, H)
    seg = _packed_segments(B, T, np.random.default_rng(0))
    mask = self_attention_mask(B, T, seg)
    want = attend_reference(q, k, v, *mask, 0.3)
    got = attend_xla(q, k, v, *mask, 0.3, q_tile=q_tile, kv_tile=kv_tile)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_tiled_matches_dense_with_cache_and_ragged_lengths():
    """Decode: T new tokens after per-row cache lengths; stale cache entries past them are garbage."""
    B, T, S, N, K, H = 3, 5, 64, 4, 1, 8
    q, k, v = _qkv(B, T, S, N, K, H, seed=1)
    lengths = jnp.array([0, 17, 40], jnp.int32)
    mask = cache_attention_mask(lengths, T, S)
    want = attend_reference(q, k, v, *mask, 0.25)
    got = attend_xla(q, k, v, *mask, 0.25, q_tile=4, kv_tile=8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    # Stale entries past each row's bound are masked (large garbage changes nothing), and KV tiles
    # past the batch's last bound (here keys >= 48) are never read at all (NaN changes nothing).
    s_idx = jnp.arange(S)[None, :, None, None]
    stale = s_idx > (lengths[:, None, None, None] + T - 1)
    k2, v2 = jnp.where(stale, 1e3, k), jnp.where(stale, 1e3, v)
    k2, v2 = jnp.where(s_idx >= 48, jnp.nan, k2), jnp.where(s_idx >= 48, jnp.nan, v2)
    got2 = attend_xla(q, k2, v2, *mask, 0.25, q_tile=4, kv_tile=8)
    np.testing.assert_allclose(np.asarray(got2), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_segment_mask_isolates_documents():
    """Changing document 1's keys must not move document 2's outputs (and vice versa)."""
    B, T, N, K, H = 1, 40, 2, 2, 4
    q, k, v = _qkv(B, T, T, N, K, H, seed=2)
    seg = jnp.asarray(np.r_[np.ones(17), 2 * np.ones(23)].astype(np.int32))[None]
    mask = self_attention_mask(B, T, seg)
    a = attend_xla(q, k, v, *mask, 0.5, q_tile=8, kv_tile=8)
    k2 = k.at[:, :17].set(-k[:, :17])
    b = attend_xla(q, k2, v, *mask, 0.5, q_tile=8, kv_tile=8)
    np.testing.assert_allclose(np.asarray(a[:, 17:]), np.asarray(b[:, 17:]), atol=1e-6)
    assert not np.allclose(np.asarray(a[:, :17]), np.asarray(b[:, :17]))


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_model_with_small_tiles_matches_hf(kind, monkeypatch, tmp_path):
    """The whole target over many query/KV tiles against transformers on a long prompt."""
    torch = pytest.importorskip("torch")
    from hf_fixtures import make_hf_model, prompt_ids  # noqa: PLC0415

    import dflash_jax  # noqa: PLC0415

    hf_model = make_hf_model(kind)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    monkeypatch.setattr(attention, "DEFAULT_Q_TILE", 64)
    monkeypatch.setattr(attention, "DEFAULT_KV_TILE", 96)
    ids = prompt_ids(520, hf_model.config.vocab_size, seed=3, batch=2)
    with torch.no_grad():
        want = hf_model(torch.tensor(ids)).logits.numpy()
    target = dflash_jax.load_target(tmp_path)
    got = np.asarray(nnx.jit(lambda m, x: m(x).logits)(target, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _target_temp_bytes(T: int) -> int:
    cfg = tiny_target_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16)
    model = nnx.eval_shape(lambda: TargetModel(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def forward(state, ids, seg):
        m = nnx.merge(graphdef, state)
        out = m(ids, segment_ids=seg, layer_ids=(0, 1), return_logits=False)
        return out.features, out.hidden

    ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
    compiled = jax.jit(forward).lower(state, ids, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_target_forward_temp_memory_grows_linearly_in_length():
    """AOT temp bytes at T=2048 vs 8192: dense [T, T] scores would give ~16x; tiles give ~4x."""
    small, large = _target_temp_bytes(2048), _target_temp_bytes(8192)
    assert large / small < 5.0, (small, large, large / small)
