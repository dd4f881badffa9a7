"""Gated DeltaNet math: chunked form == per-token recurrence == transformers' torch reference;
document restarts in packed rows; masked tokens leave the state alone; cost linear in T."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.target.gated_deltanet import (
    causal_conv,
    chunk_gated_delta_rule,
    conv_window_at,
    l2_normalize,
    recurrent_gated_delta_rule,
    unit_lower_inverse,
)

B, HK, HV, DK, DV = 2, 2, 4, 16, 8


def inputs(T, seed=0, B=B):
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.normal(size=(B, T, HK, DK)), jnp.float32))
    k = l2_normalize(jnp.asarray(rng.normal(size=(B, T, HK, DK)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(B, T, HV, DV)), jnp.float32)
    # Realistic decays: -exp(A) * softplus(a + dt), most near 0, some strong.
    g = -jnp.exp(jnp.asarray(rng.uniform(-3, 1.5, size=(1, 1, HV)), jnp.float32)) * jax.nn.softplus(
        jnp.asarray(rng.normal(size=(B, T, HV)), jnp.float32)
    )
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, T, HV)), jnp.float32))
    s0 = jnp.asarray(rng.normal(size=(B, HV, DK, DV)) * 0.3, jnp.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("T,chunk", [(100, 32), (37, 64), (5, 2)])
def test_chunked_equals_recurrent(T, chunk):
    q, k, v, g, beta, s0 = inputs(T)
    o_ref, s_ref = jax.jit(recurrent_gated_delta_rule)(q, k, v, g, beta, initial_state=s0)
    o, s = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk_size=chunk, initial_state=s0))(
        q, k, v, g, beta
    )
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), atol=1e-5, rtol=0)


def test_recurrent_matches_transformers_reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, s0 = inputs(40)
    t = lambda a: torch.from_numpy(np.asarray(a))
    o_hf, s_hf = torch_recurrent_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(s0), output_final_state=True
    )
    o, s = jax.jit(recurrent_gated_delta_rule)(q, k, v, g, beta, initial_state=s0)
    np.testing.assert_allclose(np.asarray(o), o_hf.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(s), s_hf.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_segments_restart_the_state(fn):
    """Two documents packed in one row == each run alone from a zero state (the boundary falls
    inside a chunk, and a third document fills the end of a chunk)."""
    rule = jax.jit(
        (lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=16, **kw))
        if fn == "chunk"
        else recurrent_gated_delta_rule
    )
    T, cut1, cut2 = 64, 21, 50
    q, k, v, g, beta, _ = inputs(T, seed=3, B=1)
    seg = jnp.asarray([[0] * cut1 + [1] * (cut2 - cut1) + [2] * (T - cut2)], jnp.int32)
    o, _ = rule(q, k, v, g, beta, segment_ids=seg)
    for a, b in ((0, cut1), (cut1, cut2), (cut2, T)):
        sl = lambda x, a=a, b=b: x[:, a:b]
        o_alone, _ = rule(sl(q), sl(k), sl(v), sl(g), sl(beta))
        np.testing.assert_allclose(np.asarray(o[:, a:b]), np.asarray(o_alone), atol=1e-5, rtol=0)


def test_masked_tokens_leave_the_state_unchanged():
    """beta = g = 0 after n tokens: the final state is the state after n tokens (cache rollback)."""
    T, n = 24, 9
    q, k, v, g, beta, s0 = inputs(T, seed=5)
    keep = (jnp.arange(T) < n)[None, :, None]
    _, s = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk_size=8, initial_state=s0))(
        q, k, v, jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
    )
    _, s_n = jax.jit(recurrent_gated_delta_rule)(
        q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], initial_state=s0
    )
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_n), atol=1e-5, rtol=0)


def test_causal_conv_matches_torch_and_restarts_at_documents():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    rng = np.random.default_rng(0)
    T, Ch, W = 30, 12, 4
    x = jnp.asarray(rng.normal(size=(2, T, Ch)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(Ch, W)), jnp.float32)
    ref = causal_conv1d_fn(
        torch.from_numpy(np.asarray(x)).transpose(1, 2),
        torch.from_numpy(np.asarray(w)),
        None,
        activation="silu",
    ).transpose(1, 2)
    zeros = jnp.zeros((2, W - 1, Ch))
    np.testing.assert_allclose(np.asarray(causal_conv(x, zeros, w)), ref.numpy(), atol=1e-5, rtol=0)
    # Continuing from a window == running the whole sequence at once.
    n = 11
    tail = causal_conv(x[:, n:], conv_window_at(zeros, x, jnp.asarray([n, n])), w)
    np.testing.assert_allclose(np.asarray(tail), ref.numpy()[:, n:], atol=1e-5, rtol=0)
    # Packed: the second document's conv starts from zeros.
    seg = jnp.asarray([[0] * n + [1] * (T - n)] * 2, jnp.int32)
    packed = causal_conv(x, zeros, w, seg)
    alone = causal_conv(x[:, n:], zeros, w)
    np.testing.assert_allclose(np.asarray(packed[:, n:]), np.asarray(alone), atol=1e-6, rtol=0)


def test_chunked_cost_is_linear_in_length():
    """Compiled FLOPs per token (XLA cost analysis of the AOT-compiled function) stay flat as T
    doubles; a form quadratic in T (attention-like) would double them."""

    def flops(T):
        args = [jax.ShapeDtypeStruct(a.shape[:1] + (T,) + a.shape[2:], a.dtype) for a in inputs(8)[:5]]
        fn = lambda *a: chunk_gated_delta_rule(*a, chunk_size=64)
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return cost["flops"]

    per_token = [flops(T) / T for T in (256, 512, 1024)]
    assert max(per_token) / min(per_token) < 1.1, per_token


@pytest.mark.parametrize("n", [1, 5, 64])
def test_unit_lower_inverse_equals_numpy(n):
    rng = np.random.default_rng(n)
    M = np.tril(rng.uniform(-0.3, 0.3, size=(3, n, n)), -1) + np.eye(n)  # |k_i.k_j| beta-scaled
    got = jax.jit(unit_lower_inverse)(jnp.asarray(M, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), np.linalg.inv(M), atol=1e-5, rtol=1e-5)


def test_chunked_form_runs_on_eight_devices_without_lapack():
    """Replicated on 8 simulated CPU devices (as in training and held-out decoding), the chunked
    rule compiles to plain XLA ops: a LAPACK triangular solve here deadlocked the intra-op thread
    pool (every device's call waiting for batch work queued behind the others)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from dflash_jax.sharding import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=8))
    rep = NamedSharding(mesh, PartitionSpec())
    args = [jax.device_put(a, rep) for a in inputs(100)]
    fn = jax.jit(
        lambda q, k, v, g, b, s0: chunk_gated_delta_rule(q, k, v, g, b, chunk_size=32, initial_state=s0)
    )
    assert "custom-call" not in fn.lower(*args).compile().as_text()
    o, s = fn(*args)
    o_ref, s_ref = jax.jit(recurrent_gated_delta_rule)(*inputs(100)[:5], initial_state=inputs(100)[5])
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5, rtol=0)
