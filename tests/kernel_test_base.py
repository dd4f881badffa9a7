"""Shared test base for implementations of ``pallas_kernels.anchored_attention.context_attention``.

A subclass names an implementation (``IMPL`` plus keyword ``OPTIONS``); every test here runs it
against the dense ``reference`` on the same inputs: out, lse and the gradients of q, k, v (with
cotangents on out *and* lse, since the drafter merges the two parts by their lse). Cases: several
documents per row, anchors at document starts and ends, padded (invalid) anchors, unsorted
anchors, GQA and MHA, sliding windows, sizes that are no multiple of any tile, T = A*S = 1, bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.anchored_attention import MASKED, AnchoredMask, context_attention


def packed_case(seed, *, B=2, T=40, A=10, S=4, N=4, K=2, H=16, docs=4, sort=True, dtype=jnp.float32):
    """Rows packed with ``docs`` documents and trailing padding; anchors include document starts and
    ends and one invalid (padding) anchor per row. Returns (q, k, v) and the mask."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    anchors = np.zeros((B, A), np.int32)
    valid = np.ones((B, A), bool)
    for b in range(B):
        n_cuts = min(docs - 1, max(T - 8, 0))
        cuts = np.sort(rng.choice(np.arange(3, T - 4), size=n_cuts, replace=False)) if n_cuts else []
        bounds = [0, *list(cuts), T - int(rng.integers(0, min(4, T)))]
        picks = set()
        for d in range(len(bounds) - 1):
            lo, hi = int(bounds[d]), int(bounds[d + 1])
            seg[b, lo:hi] = d + 1
            pos[b, lo:hi] = np.arange(hi - lo) + (5 if d == 0 else 0)  # a row may not start at 0
            if hi > lo:
                picks |= {lo, hi - 1}
        picks |= set(rng.choice(max(bounds[-1], 1), size=A, replace=True).tolist())
        a = np.array(sorted(picks))[:A]
        if len(a) < A:
            a = np.concatenate([a, rng.choice(max(bounds[-1], 1), size=A - len(a))])
        a = np.sort(a) if sort else rng.permutation(a)
        anchors[b] = a
        if A > 1:
            valid[b, -1] = False  # an invalid anchor (padding of the anchor list)
    mask = AnchoredMask.for_packed_rows(
        jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(anchors), jnp.asarray(valid), S
    )
    shapes = [(B, A, S, N, H), (B, T, K, H), (B, T, K, H)]
    qkv = tuple(jnp.asarray(rng.normal(size=s).astype(np.float32)).astype(dtype) for s in shapes)
    return qkv, mask


CASES = {
    # name: (packed_case kwargs, window)
    "docs_gqa": (dict(seed=0), None),
    "docs_gqa_seed1": (dict(seed=1, T=70, A=14, S=4), None),
    "mha": (dict(seed=2, N=2, K=2), None),
    "window": (dict(seed=3), 7),
    "odd_sizes_g3": (dict(seed=4, T=37, A=5, S=3, N=6, K=2), None),
    "odd_sizes_window": (dict(seed=5, T=53, A=7, S=5, N=3, K=1), 11),
    "unsorted_anchors": (dict(seed=6, sort=False), None),
    "one_by_one": (dict(seed=7, B=1, T=1, A=1, S=1, N=2, K=1), None),
    "long_docs": (dict(seed=9, T=130, A=12, S=4, docs=2), None),
    "head_dim_64": (dict(seed=8, B=1, T=33, A=4, S=4, H=64), None),
}


def _loss_fn(impl, options, window, mask, cot_o, cot_lse):
    def loss(q, k, v):
        o, lse = context_attention(q, k, v, *mask, window=window, impl=impl, **options)
        seen = lse > MASKED / 2  # lse of slots that see nothing is a constant: leave it out
        return jnp.sum(o * cot_o) + jnp.sum(jnp.where(seen, lse, 0.0) * cot_lse), (o, lse)

    return loss


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _values_and_grads(impl, options_items, window, qkv, mask, cot_o, cot_lse):
    loss = _loss_fn(impl, dict(options_items), window, mask, cot_o, cot_lse)
    (_, (o, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*qkv)
    return o, lse, grads


def run_impl(impl, options, window, qkv, mask, seed=0):
    rng = np.random.default_rng(seed + 100)
    B, A, S, N, H = qkv[0].shape
    cot_o = jnp.asarray(rng.normal(size=(B, A, S, N, H)).astype(np.float32))
    cot_lse = jnp.asarray(rng.normal(size=(B, A, S, N)).astype(np.float32))
    return _values_and_grads(impl, tuple(sorted(options.items())), window, qkv, mask, cot_o, cot_lse)


def assert_close(got, want, *, dtype, name):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)
    else:  # bf16: 2e-2 of the largest magnitude
        err = np.max(np.abs(got - want))
        assert err <= 2e-2 * max(np.max(np.abs(want)), 1e-6), f"{name}: max error {err}"


class ContextAttentionTestBase:
    """Subclass with ``IMPL`` and ``OPTIONS``; pytest collects the ``Test*`` subclasses."""

    IMPL: str = "reference"
    OPTIONS: dict = {}
    ONLY_CASES: tuple[str, ...] | None = None  # a cheaper subclass may run a subset of CASES

    def check_case(self, case_kwargs, window, dtype=jnp.float32):
        qkv, mask = packed_case(**case_kwargs, dtype=dtype)
        ref_o, ref_lse, ref_grads = run_impl("reference", {}, window, qkv, mask)
        o, lse, grads = run_impl(self.IMPL, self.OPTIONS, window, qkv, mask)
        assert_close(o, ref_o, dtype=dtype, name="out")
        seen = np.asarray(ref_lse) > MASKED / 2
        assert seen.any() and (~seen).any(), "a case should have slots with and without context"
        np.testing.assert_array_equal(np.asarray(lse) > MASKED / 2, seen, err_msg="empty rows")
        assert_close(np.where(seen, lse, 0), np.where(seen, ref_lse, 0), dtype=dtype, name="lse")
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
            assert g.dtype == dtype, name
            assert_close(g, r, dtype=dtype, name=name)

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_values_and_grads_equal_reference(self, case):
        if self.ONLY_CASES is not None and case not in self.ONLY_CASES:
            pytest.skip(f"{type(self).__name__} runs only {self.ONLY_CASES}")
        kwargs, window = CASES[case]
        if case == "one_by_one":  # a single slot with context is impossible at T=1: skip `seen.any`
            self.check_edge_t1(kwargs)
            return
        self.check_case(kwargs, window)

    def check_edge_t1(self, kwargs):
        """T = A*S = 1: the one slot sees nothing (an anchor at 0): out 0, lse MASKED, zero grads."""
        qkv, mask = packed_case(**kwargs)
        o, lse, grads = run_impl(self.IMPL, self.OPTIONS, None, qkv, mask)
        ref_o, ref_lse, ref_grads = run_impl("reference", {}, None, qkv, mask)
        np.testing.assert_array_equal(np.asarray(o), 0.0)
        np.testing.assert_array_equal(np.asarray(lse), np.float32(MASKED))
        for g, r in zip(grads, ref_grads, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        # ... and an anchor past the only context entry sees it: out = v exactly.
        mask1 = mask._replace(anchors=jnp.ones_like(mask.anchors), anchor_segment_ids=mask.ctx_segment_ids)
        o1, lse1, _ = run_impl(self.IMPL, self.OPTIONS, None, qkv, mask1)
        ref_o1, ref_lse1, ref_grads1 = run_impl("reference", {}, None, qkv, mask1)
        np.testing.assert_allclose(o1, ref_o1, atol=1e-6)
        np.testing.assert_allclose(o1[0, 0, 0, 0], qkv[2][0, 0, 0], atol=1e-6)
        np.testing.assert_allclose(lse1, ref_lse1, atol=1e-6)

    @pytest.mark.parametrize("case", ["docs_gqa", "window"])
    def test_bf16(self, case):
        if self.ONLY_CASES is not None and case not in self.ONLY_CASES:
            pytest.skip(f"{type(self).__name__} runs only {self.ONLY_CASES}")
        kwargs, window = CASES[case]
        self.check_case(kwargs, window, dtype=jnp.bfloat16)
