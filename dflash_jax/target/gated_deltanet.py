"""Gated DeltaNet (the linear-attention layers of Qwen3.5 / Qwen3.6): the causal depthwise conv and
the gated delta rule, in a chunked parallel form and a per-token recurrent reference.

The recurrence per value head (state S [Dk, Dv], fp32), for each token t:

    S <- S * exp(g_t)                          decay (g_t <= 0, log space)
    S <- S + k_t (beta_t (v_t - k_t^T S))^T    delta-rule write
    o_t = S^T q_t / sqrt(Dk)

The chunked form (``chunk_gated_delta_rule``) computes the same thing with matmuls inside chunks of
C tokens and one ``lax.scan`` over the T/C chunks (the WY/UT form: the inverse of a unit lower
triangular matrix per chunk turns the C sequential writes into matrix products), so its cost is
linear in T. That inverse is built from matmuls by blocks (``unit_lower_inverse``), not with
``lax.linalg.triangular_solve``: on CPU the latter is a LAPACK call that parallelises over the batch
on XLA's intra-op thread pool and deadlocks when several devices run it at once (8 simulated
devices: every pool thread waits for work queued behind it).

Packed rows: with ``segment_ids`` the state restarts (from zero) at every document boundary, and
no conv tap reads across one. Masked tokens (``beta = 0`` and ``g = 0``) leave the state unchanged,
which is how a cache is rolled back to a shorter length (``replay``).

Dimension names: B batch, T length, N chunks, C chunk length, Hk key heads, Hv value heads (each
key head serves Hv/Hk consecutive value heads), Dk / Dv head dims, Ch conv channels, W conv taps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in fp32 (as transformers and FLA do)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(
    x: jax.Array, window: jax.Array, weight: jax.Array, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Causal depthwise conv1d + SiLU.

    x [B,T,Ch] inputs; window [B,W-1,Ch] the inputs just before x (zeros at a sequence start);
    weight [Ch,W] (HF ``conv1d.weight[:, 0, :]``: tap W-1 multiplies the current token).
    segment_ids [B,T]: taps never read another document's inputs. Computed in fp32.
    """
    B, T, _ = x.shape
    W = weight.shape[-1]
    xp = jnp.concatenate([window.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
    w = weight.astype(jnp.float32)
    if segment_ids is not None:
        segp = jnp.concatenate([jnp.repeat(segment_ids[:, :1], W - 1, axis=1), segment_ids], axis=1)
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(W):  # W = 4: a few shifted multiply-adds
        tap = xp[:, j : j + T] * w[:, j]
        if segment_ids is not None and j < W - 1:
            tap = jnp.where((segp[:, j : j + T] == segment_ids)[..., None], tap, 0.0)
        out = out + tap
    return jax.nn.silu(out).astype(x.dtype)


def conv_window_at(window: jax.Array, x: jax.Array, n: jax.Array) -> jax.Array:
    """The W-1 inputs just before position n of x: rows of concat(window, x)[n : n+W-1].

    window [B,W-1,Ch], x [B,T,Ch], n [B] in [0, T]."""
    xp = jnp.concatenate([window, x.astype(window.dtype)], axis=1)
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, window.shape[1], axis=0))(xp, n)


def _expand_heads(x: jax.Array, num_v_heads: int) -> jax.Array:
    """[B,T,Hk,D] -> [B,T,Hv,D]: key head h serves value heads h*r .. h*r+r-1."""
    r = num_v_heads // x.shape[2]
    return x if r == 1 else jnp.repeat(x, r, axis=2)


def _resets(segment_ids: jax.Array | None, B: int, T: int) -> jax.Array:
    """[B,T] bool: token t starts a new document (its state starts from zero)."""
    if segment_ids is None:
        return jnp.zeros((B, T), bool)
    prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    return segment_ids != prev


def unit_lower_inverse(M: jax.Array) -> jax.Array:
    """Inverse of unit lower triangular matrices M [..., n, n] with matmuls only.

    By 2x2 blocks: inv([[A, 0], [C, D]]) = [[inv(A), 0], [-inv(D) C inv(A), inv(D)]], recursing
    on A and D together (stacked), log2(n) levels; n is padded to a power of two with identity."""
    n = M.shape[-1]
    size = 1 << (n - 1).bit_length()
    if size != n:
        pad = [(0, 0)] * (M.ndim - 2) + [(0, size - n)] * 2
        M = jnp.pad(M, pad) + jnp.diag((jnp.arange(size) >= n).astype(M.dtype))
    return _unit_lower_inverse_pow2(M)[..., :n, :n]


def _unit_lower_inverse_pow2(M: jax.Array) -> jax.Array:
    n = M.shape[-1]
    if n == 1:
        return jnp.ones_like(M)
    h = n // 2
    diag = _unit_lower_inverse_pow2(jnp.stack([M[..., :h, :h], M[..., h:, h:]], axis=-3))
    inv_a, inv_d = diag[..., 0, :, :], diag[..., 1, :, :]
    lower = -jnp.einsum("...ij,...jk,...kl->...il", inv_d, M[..., h:, :h], inv_a)
    top = jnp.concatenate([inv_a, jnp.zeros_like(inv_a)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([lower, inv_d], axis=-1)], axis=-2)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None):
    """The per-token reference: one ``lax.scan`` step per token (tests and small T only).

    q, k [B,T,Hk,Dk] (already L2-normalised), v [B,T,Hv,Dv], g, beta [B,T,Hv],
    initial_state [B,Hv,Dk,Dv] -> (o [B,T,Hv,Dv] in v.dtype, final state fp32)."""
    B, T, Hv, Dv = v.shape
    Dk = k.shape[-1]
    q = _expand_heads(q, Hv).astype(jnp.float32) * Dk**-0.5
    k = _expand_heads(k, Hv).astype(jnp.float32)
    S0 = (
        jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )
    reset = _resets(segment_ids, B, T)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs
        S = jnp.where(r_t[:, None, None, None], 0.0, S) * jnp.exp(g_t)[..., None, None]
        mem = jnp.einsum("BHK,BHKV->BHV", k_t, S)
        delta = (v_t - mem) * b_t[..., None]
        S = S + jnp.einsum("BHK,BHV->BHKV", k_t, delta)
        return S, jnp.einsum("BHK,BHKV->BHV", q_t, S)

    xs = (q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), reset)
    S, o = jax.lax.scan(step, S0, jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), xs))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, initial_state=None, segment_ids=None):
    """The chunked parallel form (same arguments and results as ``recurrent_gated_delta_rule``).

    Within a chunk everything is a matmul (including the triangular inverse); the state is carried
    across chunks by a ``lax.scan``. T need not be a multiple of ``chunk_size`` (padding tokens have
    beta = g = 0, so they leave the state alone)."""
    B, T, Hv, Dv = v.shape
    Dk = k.shape[-1]
    C = max(1, min(int(chunk_size), T))
    N = -(-T // C)
    pad = N * C - T
    f32 = jnp.float32
    q = _expand_heads(q, Hv).astype(f32) * Dk**-0.5
    k = _expand_heads(k, Hv).astype(f32)
    v32, g32, b32 = v.astype(f32), g.astype(f32), beta.astype(f32)
    reset = _resets(segment_ids, B, T)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if pad:
        padt = lambda a, val=0: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=val)
        q, k, v32, g32, b32, reset = (padt(a) for a in (q, k, v32, g32, b32, reset))
        seg = jnp.concatenate([seg, jnp.repeat(seg[:, -1:], pad, axis=1)], axis=1)

    # [B,N,C,...] views; heads stay named: einsums below spell them out.
    chunked = lambda a: a.reshape(B, N, C, *a.shape[2:])
    q, k, v32, g32, b32, reset, seg = (chunked(a) for a in (q, k, v32, g32, b32, reset, seg))

    gamma = jnp.cumsum(g32, axis=2)  # [B,N,C,H] log decay from the chunk start to each token
    i_idx, j_idx = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    same = seg[:, :, :, None] == seg[:, :, None, :]  # [B,N,C,C]
    lower_incl = (i_idx >= j_idx) & same
    lower_strict = (i_idx > j_idx) & same
    # exp(gamma_i - gamma_j) for j <= i in the same document; masked before exp (no overflow).
    diff = gamma[:, :, :, None, :] - gamma[:, :, None, :, :]  # [B,N,Ci,Cj,H]
    decay = jnp.exp(jnp.where(lower_incl[..., None], diff, -jnp.inf))

    kk = jnp.einsum("BNIHK,BNJHK->BNIJH", k, k)
    A = jnp.where(lower_strict[..., None], kk * decay * b32[:, :, :, None, :], 0.0)
    M = jnp.moveaxis(A, -1, 2) + jnp.eye(C, dtype=f32)  # [B,N,H,C,C], unit lower triangular
    rhs_u = jnp.moveaxis(v32 * b32[..., None], 3, 2)  # [B,N,H,C,Dv]
    rhs_w = jnp.moveaxis(k * (b32 * jnp.exp(gamma))[..., None], 3, 2)  # [B,N,H,C,Dk]
    M_inv = unit_lower_inverse(M)
    U = jnp.einsum("BNHIJ,BNHJV->BNHIV", M_inv, rhs_u)
    Wk = jnp.einsum("BNHIJ,BNHJK->BNHIK", M_inv, rhs_w)

    # Tokens before the chunk's first document boundary continue the carried state; later ones
    # (and their W rows) start from zero.
    sees_state = jnp.cumsum(reset.astype(jnp.int32), axis=2) == 0  # [B,N,C]
    sees_h = jnp.moveaxis(sees_state[..., None], 3, 2)  # [B,N,1,C]
    Wk = Wk * sees_h[..., None]
    q_dec = jnp.moveaxis(q * jnp.exp(gamma)[..., None], 3, 2) * sees_h[..., None]  # [B,N,H,C,Dk]
    intra = jnp.einsum("BNIHK,BNJHK->BNHIJ", q, k) * jnp.moveaxis(decay, -1, 2)
    # Only the chunk's last document writes into the state handed to the next chunk.
    in_last = seg == seg[:, :, -1:]  # [B,N,C]
    k_tail = k * (jnp.exp(gamma[:, :, -1:] - gamma) * in_last[..., None])[..., None]
    k_tail = jnp.moveaxis(k_tail, 3, 2)  # [B,N,H,C,Dk]
    carry_decay = jnp.exp(gamma[:, :, -1]) * sees_state[:, :, -1:]  # [B,N,H]

    S0 = jnp.zeros((B, Hv, Dk, Dv), f32) if initial_state is None else initial_state.astype(f32)

    def step(S, xs):
        u, w, qd, att, kt, cd = xs
        v_new = u - jnp.einsum("BHCK,BHKV->BHCV", w, S)
        o = jnp.einsum("BHCK,BHKV->BHCV", qd, S) + jnp.einsum("BHIJ,BHJV->BHIV", att, v_new)
        S = S * cd[..., None, None] + jnp.einsum("BHCK,BHCV->BHKV", kt, v_new)
        return S, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (U, Wk, q_dec, intra, k_tail, carry_decay))
    S, o = jax.lax.scan(step, S0, xs)  # o [N,B,H,C,Dv]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, N * C, Hv, Dv)[:, :T]
    return o.astype(v.dtype), S
