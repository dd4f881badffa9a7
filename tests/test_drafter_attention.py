"""Anchored block attention: the memory-bounded ``xla`` path equals the dense ``reference``
(values and gradients) on packed batches with several documents, anchors at document starts and
ends, padding anchors and GQA; and the ``xla`` path never builds the dense ``A*S x (T + A*S)`` scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import packed_case

from dflash_jax.drafter.attention import anchored_attention
from dflash_jax.drafter.masks import AnchoredMask


def random_packed(seed, B=2, T=40, A=10, S=4, N=4, K=2, H=8):
    """Rows packed with 3-4 documents and padding (kernel_test_base.packed_case), plus random
    in-block keys and values."""
    (q, k_ctx, v_ctx), mask = packed_case(seed, B=B, T=T, A=A, S=S, N=N, K=K, H=H)
    rng = np.random.default_rng(seed + 1000)
    k_blk, v_blk = (jnp.asarray(rng.normal(size=(B, A, S, K, H)).astype(np.float32)) for _ in range(2))
    return (q, k_ctx, v_ctx, k_blk, v_blk), mask


@functools.partial(jax.jit, static_argnames=("impl", "causal", "window", "chunk"))
def value_and_grads(args, mask, cot, *, impl, causal, window, chunk):
    def f(*args):
        out = anchored_attention(*args, mask, causal=causal, window=window, impl=impl, anchor_chunk=chunk)
        return jnp.sum(out * cot), out

    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True)(*args)
    return out, grads


@pytest.mark.parametrize(
    "causal,window,chunk",
    [(False, None, 3), (True, None, 4), (False, 7, 16), (True, 5, 3)],
)
def test_xla_equals_reference_values_and_grads(causal, window, chunk):
    for seed in (0, 1):
        args, mask = random_packed(seed)
        cot = jnp.asarray(np.random.default_rng(seed + 7).normal(size=args[0].shape).astype(np.float32))
        ref_out, ref_grads = value_and_grads(
            args, mask, cot, impl="reference", causal=causal, window=window, chunk=chunk
        )
        out, grads = value_and_grads(args, mask, cot, impl="xla", causal=causal, window=window, chunk=chunk)
        assert np.isfinite(np.asarray(out)).all()
        np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
        for name, g, r in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads, ref_grads, strict=True):
            assert np.isfinite(np.asarray(g)).all(), name
            np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=name)


def test_reference_mask_semantics_by_hand():
    """The reference itself, on a hand-checked case: an anchor at a document start attends only
    to its own block; another attends to exactly its visible context plus its block."""
    args, mask = random_packed(3, B=1, T=12, A=2, S=2, N=2, K=1, H=4)
    seg = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0]])
    pos = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 0]])
    mask = AnchoredMask.for_packed_rows(seg, pos, jnp.array([[5, 8]]), jnp.array([[True, True]]), 2)
    q, k_ctx, v_ctx, k_blk, v_blk = (np.asarray(x, np.float64) for x in args)
    out = np.asarray(anchored_attention(*args, mask, causal=False, impl="reference"))
    # Anchor 5 starts document 2: no context. Anchor 8 sees positions 5, 6, 7 of document 2.
    for j, ctx_idx in ((0, []), (1, [5, 6, 7])):
        keys = np.concatenate([k_ctx[0, ctx_idx, 0], k_blk[0, j, :, 0]])
        values = np.concatenate([v_ctx[0, ctx_idx, 0], v_blk[0, j, :, 0]])
        s = np.einsum("kne,pe->knp", q[0, j], keys) / 2.0  # head_dim 4 -> scale 1/2
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[0, j], np.einsum("knp,pe->kne", p, values), atol=1e-5)


def _grad_temp_bytes(impl, A, T=2048, S=16, N=4, K=2, H=16):
    """Compiled temp memory of d(sum(attention))/d(q, k_ctx, v_ctx) on abstract shapes."""
    B, f32, i32 = 1, jnp.float32, jnp.int32
    shapes = [(B, A, S, N, H), (B, T, K, H), (B, T, K, H), (B, A, S, K, H), (B, A, S, K, H)]
    args = [jax.ShapeDtypeStruct(s, f32) for s in shapes]
    mask = AnchoredMask(
        ctx_segment_ids=jax.ShapeDtypeStruct((B, T), i32),
        ctx_positions=jax.ShapeDtypeStruct((B, T), i32),
        anchors=jax.ShapeDtypeStruct((B, A), i32),
        anchor_segment_ids=jax.ShapeDtypeStruct((B, A), i32),
        slot_positions=jax.ShapeDtypeStruct((B, A, S), i32),
    )

    def loss(q, k_ctx, v_ctx, k_blk, v_blk, mask):
        out = anchored_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask, causal=False, impl=impl, anchor_chunk=8)
        return jnp.sum(out)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_xla_memory_is_bounded_by_a_chunk():
    """Forward + backward: the dense path holds A*S x (T + A*S) scores; the chunked path holds a
    few chunks' worth whatever the number of anchors."""
    T, S, N = 2048, 16, 4

    def dense_scores(A):
        return A * S * N * (T + A * S) * 4

    ref64, xla64, xla256 = (
        _grad_temp_bytes("reference", 64),
        _grad_temp_bytes("xla", 64),
        _grad_temp_bytes("xla", 256),
    )
    assert ref64 >= dense_scores(64)  # the dense path does hold the full score matrix ...
    assert xla64 < dense_scores(64) / 2, (xla64, dense_scores(64))  # ... the chunked one does not
    assert xla256 < 1.5 * xla64, (xla64, xla256)  # and 4x the anchors costs almost nothing more
    assert xla256 < dense_scores(256) / 10
