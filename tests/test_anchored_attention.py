"""Every implementation of the context attention against the dense reference (kernel_test_base),
plus the tile tables the Pallas kernels skip by, and the dispatch."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import CASES, ContextAttentionTestBase, packed_case

from pallas_kernels.anchored_attention import api, context_attention, validated
from pallas_kernels.anchored_attention.pallas_triton import TileConfig
from pallas_kernels.anchored_attention.tile_tables import context_tiles, query_tiles

# Tiny tiles so that the small cases span several query and context tiles (masked, unmasked, skipped).
SMALL = TileConfig(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


class TestXla(ContextAttentionTestBase):
    IMPL = "xla"
    OPTIONS = {"chunk": 3}


class TestPallasInterpret(ContextAttentionTestBase):
    IMPL = "pallas"
    OPTIONS = {"interpret": True, "tiles": SMALL}


class TestPallasXlaBackward(ContextAttentionTestBase):
    """The debugging switch: Pallas forward, chunked XLA backward."""

    IMPL = "pallas"
    OPTIONS = {"interpret": True, "tiles": SMALL, "backward": "xla"}
    ONLY_CASES = ("docs_gqa", "window")


TABLE_CASES = [(c, 16, 16) for c in sorted(set(CASES) - {"one_by_one"})]
TABLE_CASES += [(c, bq, bk) for c in ("docs_gqa", "long_docs") for bq, bk in ((32, 16), (16, 32))]


@pytest.mark.parametrize("case,bq,bk", TABLE_CASES)
def test_tile_tables_cover_every_visible_pair(case, bq, bk):
    """[lo, hi) holds every visible (query, context) pair; [f0, f1) holds only visible ones; the
    dk/dv transpose agrees. Checked against the dense mask."""
    kwargs, window = CASES[case]
    _, mask = packed_case(**kwargs)
    B, A, S = mask.slot_positions.shape
    T = mask.ctx_segment_ids.shape[1]
    n_q = -(-A * S // bq)
    n_k = -(-T // bk)
    tables = jax.jit(
        lambda seg, anchors, anchor_seg: query_tiles(
            seg, anchors, anchor_seg, slots=S, block_q=bq, block_k=bk, n_q_tiles=n_q, window=window
        )
    )
    qt = tables(mask.ctx_segment_ids, mask.anchors, mask.anchor_segment_ids)
    ct = jax.jit(context_tiles, static_argnums=1)(qt, n_k)
    vis = np.zeros((B, n_q * bq, n_k * bk), bool)
    vis[:, : A * S, :T] = np.asarray(mask.context_visible(window)).reshape(B, A * S, T)
    vis = vis.reshape(B, n_q, bq, n_k, bk)
    any_vis, all_vis = vis.any(axis=(2, 4)), vis.all(axis=(2, 4))
    j = np.arange(n_k)[None, None, :]
    lo, f0, f1, hi = (np.asarray(x)[..., None] for x in qt)
    visited = (lo <= j) & (j < hi)
    unmasked = (f0 <= j) & (j < f1)
    assert not (any_vis & ~visited).any(), "a visible tile is skipped"
    assert not (unmasked & ~all_vis).any(), "a tile run without mask is not fully visible"
    assert ((lo <= f0) & (f0 <= f1) & (f1 <= hi)).all()
    i = np.arange(n_q)[None, :, None]
    i_lo, g0, g1, i_hi = (np.asarray(x)[:, None, :] for x in ct)
    assert not (visited & ~((i_lo <= i) & (i < i_hi))).any(), "dk/dv skips a visited tile"
    assert not (((g0 <= i) & (i < g1)) & ~unmasked).any(), "dk/dv runs a masked tile unmasked"
    if case == "long_docs" and bq == bk == 16:
        assert unmasked.any(), "packed sorted anchors should give some mask-free tiles"
        assert (~visited).any(), "packed documents should let some tiles be skipped"


def test_auto_picks_xla_on_cpu_and_logs_once(caplog):
    api._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=api.log.name):
        assert api.resolve_impl("auto") == "xla"
        assert api.resolve_impl("auto") == "xla"
    assert [r.getMessage() for r in caplog.records].count(
        "attention_impl=auto: using 'xla' (backend 'cpu' is not a GPU)"
    ) == 1
    assert api.resolve_impl("pallas") == "pallas"
    with pytest.raises(ValueError, match="flash"):
        api.resolve_impl("flash")


H200_ENTRY = {
    "device_kind": "NVIDIA H200", "head_dim": 128, "groups": 4, "dtype": "bfloat16", "window": False,
    "impl": "pallas", "tiles": TileConfig(block_q=32, num_warps_dkdv=4).to_dict(), "speedup_vs_xla": 1.7,
    "jax": "0.11.2",
}  # fmt: skip


@pytest.fixture
def on_h200(monkeypatch):
    """Pretend to be on an H200 whose validated table holds H200_ENTRY only."""
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(api.jax, "devices", lambda: [type("Dev", (), {"device_kind": "NVIDIA H200"})()])
    monkeypatch.setattr(validated, "load", lambda path=None: [H200_ENTRY])


def test_auto_picks_pallas_only_for_a_validated_gpu_configuration(on_h200):
    shape = dict(head_dim=128, groups=4, dtype=jnp.bfloat16, window=None)
    impl, entry, reason = api.choose_impl("auto", **shape)
    assert (impl, entry) == ("pallas", H200_ENTRY) and "validated for (NVIDIA H200" in reason
    for other in (dict(groups=2), dict(dtype=jnp.float32), dict(window=7), dict(head_dim=64)):
        impl, entry, reason = api.choose_impl("auto", **{**shape, **other})
        assert (impl, entry) == ("xla", None), other
        assert "no GPU check has validated a kernel for (NVIDIA H200" in reason
    assert api.choose_impl("auto")[0] == "xla"  # no shape: nothing to match
    assert api.choose_impl("pallas", **shape)[:2] == ("pallas", None)  # explicit: as asked


def test_auto_on_gpu_with_an_empty_table_is_xla(monkeypatch, caplog):
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(api.jax, "devices", lambda: [type("Dev", (), {"device_kind": "NVIDIA H200"})()])
    monkeypatch.setattr(validated, "load", lambda path=None: [])
    api._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=api.log.name):
        assert api.resolve_impl("auto", head_dim=128, groups=4, dtype="bfloat16", window=None) == "xla"
    assert "no GPU check has validated" in caplog.records[0].getMessage()


def test_validated_table_round_trip(tmp_path):
    path = tmp_path / "validated.json"
    assert validated.load(path) == []
    validated.write([H200_ENTRY], path)
    newer = {**H200_ENTRY, "speedup_vs_xla": 2.0}
    other = {**H200_ENTRY, "groups": 8}
    validated.write([newer, other], path)
    rows = validated.load(path)
    assert rows == [newer, other]  # same key replaced, sorted by key
    assert validated.lookup("NVIDIA H200", 128, 8, "bfloat16", False, table=rows) == other
    path.write_text('{"validated": [{"device_kind": "x"}]}')
    with pytest.raises(ValueError, match="entry 0 lacks"):
        validated.load(path)
    validated.load()  # the shipped table is well formed


def test_pallas_defaults_to_interpret_off_gpu():
    """impl='pallas' without options runs (in interpret mode) on CPU and equals the reference."""
    (q, k, v), mask = packed_case(0, B=1, T=24, A=4, S=4, N=2, K=1, H=16)
    got = jax.jit(lambda *a: context_attention(*a, impl="pallas", tiles=SMALL))(q, k, v, *mask)
    want = context_attention(q, k, v, *mask, impl="reference")
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)


def test_bad_shapes_are_named():
    (q, k, v), mask = packed_case(0, B=1, T=24, A=4, S=4, N=2, K=1, H=16)
    with pytest.raises(ValueError, match="anchors has shape"):
        context_attention(q, k, v, *mask._replace(anchors=mask.anchors[:, :2]), impl="xla")
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        context_attention(q[..., :1, :], jnp.concatenate([k, k], 2), jnp.concatenate([v, v], 2), *mask)
    with pytest.raises(ValueError, match="block_k=24 must be a power of two"):
        context_attention(q, k, v, *mask, impl="pallas", tiles=TileConfig(block_k=24))
    assert jax.default_backend() == "cpu"
