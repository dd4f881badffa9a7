"""The target's packed-segment attention kernel (pallas_kernels/segment_attention) in interpret mode
against a NumPy reference and the target's tiled XLA path: several documents a row, padded tails,
GQA, lengths no multiple of any tile, a KV-cache step; the tile tables' skipping; the dispatch of
``target.attention_impl`` (``auto`` on XLA unless validated.json names the GPU)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import tiny_target_config
from flax import nnx

from dflash_jax.target.attention import attend, attend_xla, cache_attention_mask, self_attention_mask
from dflash_jax.target.model import TargetModel
from pallas_kernels.segment_attention import api, segment_attention, validated
from pallas_kernels.segment_attention.pallas_triton import TileConfig
from pallas_kernels.segment_attention.tile_tables import tile_tables

SMALL = TileConfig(block_q=16, block_k=16)


def kernel(q, k, v, *mask, scale=None, tiles=SMALL):
    """The kernel in interpret mode, jitted: one compile instead of op-by-op dispatch."""
    run = jax.jit(lambda *a: segment_attention(*a, scale=scale, tiles=tiles, interpret=True))
    return run(q, k, v, *mask)


def numpy_attention(q, k, v, q_index, q_segment, kv_segment, scale):
    """Per query, per head: a softmax over the keys it sees (float64; zeros where it sees none)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    q_index, q_segment, kv_segment = (np.asarray(x) for x in (q_index, q_segment, kv_segment))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            seen = (np.arange(S) <= q_index[b, t]) & (kv_segment[b] == q_segment[b, t])
            if not seen.any():
                continue
            for n in range(N):
                kh = n // (N // K)
                s = k[b, seen, kh] @ q[b, t, n] * scale
                p = np.exp(s - s.max())
                out[b, t, n] = (p / p.sum()) @ v[b, seen, kh]
    return out


def packed_rows(B, T, rng, docs=4):
    """Rows of ``docs`` documents of random lengths, a padded (segment 0) tail on every other row."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T - 1), size=docs - 1, replace=False))
        for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, T], strict=True)):
            seg[b, lo:hi] = i + 1
        if b % 2:
            seg[b, cuts[-1] :] = 0
    return jnp.asarray(seg)


def qkv(B, T, S, N, K, H, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, H)]
    return tuple(jnp.asarray(rng.normal(size=s).astype(np.float32)).astype(dtype) for s in shapes)


@pytest.mark.parametrize(
    "B,T,N,K,H,tiles",
    [
        (2, 77, 4, 2, 16, SMALL),  # GQA, odd length: both sides padded
        (1, 50, 6, 2, 32, TileConfig(block_q=32, block_k=16)),  # G=3, unequal tiles
    ],
)
def test_kernel_matches_numpy_and_xla_on_packed_rows(B, T, N, K, H, tiles):
    q, k, v = qkv(B, T, T, N, K, H)
    mask = self_attention_mask(B, T, packed_rows(B, T, np.random.default_rng(T)))
    scale = H**-0.5
    got = kernel(q, k, v, *mask, scale=scale, tiles=tiles)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, *mask, scale), atol=2e-5, rtol=2e-5)
    xla = attend_xla(q, k, v, *mask, scale, q_tile=16, kv_tile=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(xla), atol=2e-5, rtol=2e-5)


def test_kernel_bf16_matches_xla():
    B, T, N, K, H = 1, 48, 4, 1, 16
    q, k, v = qkv(B, T, T, N, K, H, seed=3, dtype=jnp.bfloat16)
    mask = self_attention_mask(B, T, packed_rows(B, T, np.random.default_rng(3), docs=3))
    got = kernel(q, k, v, *mask)
    assert got.dtype == jnp.bfloat16
    want = attend_xla(q, k, v, *mask, H**-0.5)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2
    )


def test_kernel_on_a_kv_cache_step_with_ragged_lengths():
    """Queries at lengths[b] + t over a whole cache buffer: the stale tail is never seen."""
    B, T, S, N, K, H = 3, 5, 64, 4, 2, 16
    q, k, v = qkv(B, T, S, N, K, H, seed=1)
    mask = cache_attention_mask(jnp.array([0, 17, 40], jnp.int32), T, S)
    got = kernel(q, k, v, *mask, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, *mask, 0.25), atol=2e-5, rtol=2e-5)


def test_skipped_tiles_are_never_read():
    """NaN in every key tile a query tile must skip (earlier documents, keys past the diagonal)
    leaves that tile's outputs equal to the clean reference: the kernel never loaded them."""
    B, T, N, K, H = 1, 80, 2, 1, 16
    q, k, v = qkv(B, T, T, N, K, H, seed=2)
    seg = jnp.asarray(np.repeat([1, 2, 3], [32, 32, 16]).astype(np.int32))[None]
    mask = self_attention_mask(B, T, seg)
    clean = kernel(q, k, v, *mask)
    s = jnp.arange(T)[None, :, None, None]
    poison = (s < 32) | (s >= 48)  # for queries 32..47 (document 2's first tile)
    k2, v2 = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    got = kernel(q, k2, v2, *mask)
    np.testing.assert_array_equal(np.asarray(got[:, 32:48]), np.asarray(clean[:, 32:48]))


def test_tile_tables_of_the_docstring_example():
    seg = jnp.asarray(np.repeat([1, 2], [8, 4]).astype(np.int32))[None]
    idx = jnp.arange(12, dtype=jnp.int32)[None]
    t = tile_tables(idx, seg, seg, block_q=4, block_k=4)
    lo, f0, f1, hi = (np.asarray(x)[0].tolist() for x in t.query)
    assert (lo, hi) == ([0, 0, 2], [1, 2, 3])
    assert (f0, f1) == ([1, 0, 3], [1, 1, 3])  # only query tile 1 has a mask-free key tile (0)


@pytest.mark.parametrize("seed", [0, 1])
def test_tile_tables_cover_every_visible_pair(seed):
    """Any segment layout (unsorted, repeated ids): visible pairs lie in visited, overlapping tiles,
    and every pair of a mask-free tile is visible."""
    rng = np.random.default_rng(seed)
    T, bq, bk = 64, 8, 16
    seg = rng.integers(0, 3, size=(2, T)).astype(np.int32)  # row 1: ids in any order
    seg[0] = np.repeat([1, 2], [40, 24])  # row 0: packed
    idx = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
    t = tile_tables(jnp.asarray(idx), jnp.asarray(seg), jnp.asarray(seg), block_q=bq, block_k=bk)
    lo, f0, f1, hi = (np.asarray(x) for x in t.query)
    k_lo, k_hi = (np.asarray(x) for x in t.key_segments)
    for b in range(2):
        visible = (np.arange(T)[None, :] <= idx[b][:, None]) & (seg[b][None, :] == seg[b][:, None])
        for qt, kt in {(i // bq, j // bk) for i, j in zip(*np.nonzero(visible), strict=True)}:
            q_seg = seg[b, qt * bq : (qt + 1) * bq]
            assert lo[b, qt] <= kt < hi[b, qt], (b, qt, kt)
            assert k_hi[b, kt] >= q_seg.min() and k_lo[b, kt] <= q_seg.max()
        for qt in range(T // bq):
            assert lo[b, qt] <= f0[b, qt] <= f1[b, qt] <= hi[b, qt]
            for kt in range(f0[b, qt], f1[b, qt]):
                assert visible[qt * bq : (qt + 1) * bq, kt * bk : (kt + 1) * bk].all()
    assert (f1[0] > f0[0]).any()  # the packed row has mask-free tiles


def test_target_model_with_the_kernel_matches_xla():
    """A whole tiny target on packed rows: attention_impl=pallas (interpret mode) equals xla."""
    cfg = tiny_target_config(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, head_dim=16)
    B, T = 2, 32
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 128, size=(B, T)), jnp.int32)
    seg = packed_rows(B, T, np.random.default_rng(6), docs=3)
    outs = {}
    for impl in ("xla", "pallas"):
        model = TargetModel(cfg, rngs=nnx.Rngs(0), attention_impl=impl)
        outs[impl] = nnx.jit(lambda m, x, s: m(x, segment_ids=s, layer_ids=(0, 1)).features)(model, ids, seg)
    np.testing.assert_allclose(np.asarray(outs["pallas"]), np.asarray(outs["xla"]), atol=1e-4, rtol=1e-4)


def test_kernel_on_a_mesh_runs_on_each_devices_rows_and_heads():
    """data=2 x tensor=2: the kernel under shard_map equals the XLA path, and the compiled program
    gathers nothing (each device attends its own rows and heads)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dflash_jax.sharding import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
    B, T, N, K, H = 2, 32, 4, 2, 16
    q, k, v = qkv(B, T, T, N, K, H, seed=7)
    mask = self_attention_mask(B, T, packed_rows(B, T, np.random.default_rng(7), docs=3))
    want = attend_xla(q, k, v, *mask, 0.25)
    heads, tokens = NamedSharding(mesh, P("data", None, "tensor", None)), NamedSharding(mesh, P("data", None))
    args = [jax.device_put(x, heads) for x in (q, k, v)] + [jax.device_put(m, tokens) for m in mask]
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(lambda q, k, v, *m: attend(q, k, v, *m, 0.25, impl="pallas")).lower(*args).compile()
        )
        got = compiled(*args)
    assert "all-gather" not in compiled.as_text() and "all-to-all" not in compiled.as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_pallas_refuses_sinks_and_windows():
    q, k, v = qkv(1, 16, 16, 2, 1, 16)
    mask = self_attention_mask(1, 16)
    with pytest.raises(ValueError, match="no attention sinks or sliding window"):
        attend(q, k, v, *mask, 0.25, sinks=jnp.zeros(2), impl="pallas")
    got = attend(q, k, v, *mask, 0.25, sinks=jnp.zeros(2), impl="auto")  # auto: the XLA path
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(attend_xla(q, k, v, *mask, 0.25, sinks=jnp.zeros(2)))
    )


H200 = {"device_kind": "NVIDIA H200", "head_dim": 128, "groups": 4, "dtype": "bfloat16",
        "tiles": TileConfig(block_q=128, num_warps=8).to_dict(), "speedup_vs_xla": 3.0, "jax": "0.11.2"}  # fmt: skip
SHAPE = dict(head_dim=128, groups=4, dtype=jnp.bfloat16, query_len=4096, key_len=4096)


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(api.jax, "devices", lambda: [type("Dev", (), {"device_kind": "NVIDIA H200"})()])


def test_auto_is_xla_on_cpu_and_on_an_unvalidated_gpu(monkeypatch, caplog):
    assert api.choose_impl("auto", **SHAPE)[0] == "xla"  # this CPU host
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(api.jax, "devices", lambda: [type("Dev", (), {"device_kind": "NVIDIA H100"})()])
    monkeypatch.setattr(validated, "load", lambda path=None: [H200])
    api._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=api.log.name):
        assert api.resolve_impl("auto", **SHAPE) == ("xla", None)
    assert "no GPU check has validated the segment attention kernel for (NVIDIA H100" in caplog.text


def test_auto_picks_the_kernel_only_where_validated(on_h200, monkeypatch):
    monkeypatch.setattr(validated, "load", lambda path=None: [H200])
    impl, entry, reason = api.choose_impl("auto", **SHAPE)
    assert (impl, entry) == ("pallas", H200) and "validated for (NVIDIA H200" in reason
    for other in (
        dict(groups=2),
        dict(dtype=jnp.float32),
        dict(head_dim=64),
        dict(query_len=16),  # a KV-cache step
        dict(sinks=True),
        dict(window=True),
    ):
        assert api.choose_impl("auto", **{**SHAPE, **other})[:2] == ("xla", None), other
    assert api.choose_impl("pallas", **{**SHAPE, "groups": 2})[0] == "pallas"  # explicit: as asked
    with pytest.raises(ValueError, match="unknown target attention impl 'cudnn'"):
        api.choose_impl("cudnn", **SHAPE)


def test_validated_table_round_trip(tmp_path):
    path = tmp_path / "validated.json"
    assert validated.load(path) == []
    validated.write([H200], path)
    validated.write([{**H200, "speedup_vs_xla": 4.0}, {**H200, "device_kind": "NVIDIA H100 80GB HBM3"}], path)
    rows = validated.load(path)
    assert (
        len(rows) == 2
        and validated.lookup("NVIDIA H200", 128, 4, "bfloat16", table=rows)["speedup_vs_xla"] == 4.0
    )
    assert isinstance(validated.load(), list)  # the shipped table parses (load checks its entries)


def test_bad_shapes_and_tiles_are_named():
    q, k, v = qkv(1, 16, 16, 4, 2, 16)
    mask = self_attention_mask(1, 16)
    with pytest.raises(ValueError, match="kv_segment has shape"):
        segment_attention(q, k, v, mask[0], mask[1], mask[2][:, :8], interpret=True)
    with pytest.raises(ValueError, match="block_k=24 must be a power of two"):
        TileConfig(block_k=24)
    with pytest.raises(ValueError, match="head_dim=24"):
        segment_attention(*qkv(1, 16, 16, 2, 1, 24), *mask, interpret=True)
