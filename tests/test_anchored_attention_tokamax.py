"""``impl="tokamax"``: tokamax's attention op for the forward (key ranges per query, softmax
residuals -> lse) and our backward, against the dense reference through the kernel test base.
On CPU tokamax's Mosaic GPU kernel cannot run (nor lower: it asks the device for sm90), so these
tests run tokamax's dense ``xla`` op through the same masks, residual handling and custom VJP; the
backward is the Pallas kernels in interpret mode (``backward="pallas"``) or the chunked XLA one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import ContextAttentionTestBase, packed_case

from pallas_kernels.anchored_attention import context_attention, tokamax_impl
from pallas_kernels.anchored_attention.pallas_triton import TileConfig

pytest.importorskip("tokamax", reason="tokamax is installed by scripts/setup.sh")

SMALL = TileConfig(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
# No sliding window (tokamax_impl refuses it), no T=1 edge; few cases: each runs interpret-mode kernels.
CASES = ("docs_gqa", "odd_sizes_g3", "unsorted_anchors")


class TestTokamaxXlaOpPallasBackward(ContextAttentionTestBase):
    IMPL = "tokamax"
    OPTIONS = {"tokamax_implementation": "xla", "interpret": True, "tiles": SMALL}
    ONLY_CASES = CASES


class TestTokamaxXlaOpXlaBackward(ContextAttentionTestBase):
    IMPL = "tokamax"
    OPTIONS = {"tokamax_implementation": "xla", "backward": "xla", "chunk": 3}
    ONLY_CASES = ("docs_gqa",)


def test_lse_gradient_reaches_q_and_k():
    """The merge differentiates through lse: a loss on lse alone has non-zero dq/dk, equal to the
    reference's (tokamax's own VJP would drop this cotangent)."""
    (q, k, v), mask = packed_case(3)

    def grads(impl, **kw):
        def f(q, k):
            lse = context_attention(q, k, v, *mask, impl=impl, **kw)[1]
            return jnp.sum(jnp.where(lse > -1e29, lse, 0.0))

        return jax.jit(jax.grad(f, argnums=(0, 1)))(q, k)

    got = grads("tokamax", tokamax_implementation="xla", backward="xla")
    want = grads("reference")
    for g, w in zip(got, want, strict=True):
        assert float(jnp.max(jnp.abs(w))) > 0.1
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_key_ranges_and_window_refusal():
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    start, end = tokamax_impl.key_ranges(seg, jnp.array([[2, 5, 3]]), jnp.array([[1, 2, 2]]), slots=2)
    np.testing.assert_array_equal(start, [[0, 0, 3, 3, 0, 0]])  # anchor 3 at doc 2's start: empty
    np.testing.assert_array_equal(end, [[2, 2, 5, 5, 0, 0]])
    (q, k, v), mask = packed_case(0)
    with pytest.raises(ValueError, match="does not take a sliding window"):
        context_attention(q, k, v, *mask, window=4, impl="tokamax", tokamax_implementation="xla")


def test_packed_causal_target_attention_equals_ours():
    from dflash_jax.target.attention import attend_reference, self_attention_mask

    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, 24, 4, 2, 16
    q, k, v = (
        jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))
    )
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 9 + [3] * 5], B, axis=0), jnp.int32)
    got = tokamax_impl.packed_causal_attention_tokamax(q, k, v, seg, scale=H**-0.5, implementation="xla")
    want = attend_reference(q, k, v, *self_attention_mask(B, T, seg), H**-0.5)
    np.testing.assert_allclose(got, want, atol=1e-5)
