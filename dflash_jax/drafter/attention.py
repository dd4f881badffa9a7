"""Anchored block attention: block queries over ``[context ; own block]`` keys.

Shapes (named in einsums): B batch, A anchors (blocks), S slots per block, T context length,
N query heads = K kv heads x G group, H head_dim.

  q      [B, A, S, N, H]   slot queries (q-normed, roped)
  k_ctx  [B, T, K, H]      context keys (k-normed, roped), v_ctx likewise
  k_blk  [B, A, S, K, H]   each block's own keys, v_blk likewise
  out    [B, A, S, N, H]

Implementations (``DrafterConfig.attention_impl``):

* ``reference``: one dense softmax over ``[T + A*S]`` keys with the full mask. Obviously correct,
  memory ``A*S x (T + A*S)``: tests only.
* ``xla``: the context part runs per chunk of ``anchor_chunk`` anchors (``lax.map`` +
  ``jax.checkpoint``, so the forward and the backward hold one chunk's ``[Ac*S, T]`` scores at a
  time), the in-block part is a tiny ``[S, S]`` attention per block, and the two are merged by
  their log-sum-exps. Anchors sorted ascending let a chunk bound its context to
  ``[doc_start(first anchor), last anchor)``; XLA needs static shapes so this path still scans
  all T, a Pallas kernel skips the fully masked context tiles.
* ``pallas``: ``pallas_kernels.anchored_attention.context_attention`` supplies the context part
  ``(o, lse)``; the in-block part and the merge are shared with ``xla``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.drafter.masks import AnchoredMask, block_visible, context_visible

# Finite "minus infinity": a row with nothing visible then has lse ~ -1e30, a merge weight of
# exactly 0 and finite (if meaningless) values and gradients, instead of NaNs.
_MASKED = -1e30


def anchored_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    mask: AnchoredMask,
    *,
    causal: bool,
    window: int | None = None,
    impl: str = "xla",
    anchor_chunk: int = 16,
    scale: float | None = None,
) -> jax.Array:
    """Attention of every block's slots over its visible context and its own block (see module doc)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_shapes(q, k_ctx, v_ctx, k_blk, v_blk, mask)
    if impl == "reference":
        return reference_attention(
            q, k_ctx, v_ctx, k_blk, v_blk, mask, causal=causal, window=window, scale=scale
        )
    o_blk, lse_blk = _block_part(q, k_blk, v_blk, mask.block_visible(causal, window), scale)
    if impl == "xla":
        o_ctx, lse_ctx = context_attention_xla(
            q, k_ctx, v_ctx, mask, window=window, scale=scale, chunk=anchor_chunk
        )
    elif impl == "pallas":
        try:
            from pallas_kernels import anchored_attention as kernel
        except ImportError as e:  # the kernel lands in its own issue
            raise NotImplementedError(
                "attention_impl='pallas' needs pallas_kernels.anchored_attention.context_attention"
            ) from e
        o_ctx, lse_ctx = kernel.context_attention(
            q,
            k_ctx,
            v_ctx,
            mask.ctx_segment_ids,
            mask.ctx_positions,
            mask.anchors,
            mask.anchor_segment_ids,
            mask.slot_positions,
            window=window,
            scale=scale,
        )
    else:
        raise ValueError(f"unknown attention impl {impl!r}; expected reference | xla | pallas")
    return merge_partials(o_ctx, lse_ctx, o_blk, lse_blk).astype(q.dtype)


def _check_shapes(q, k_ctx, v_ctx, k_blk, v_blk, mask):
    B, A, S, N, H = q.shape
    T, K = k_ctx.shape[1], k_ctx.shape[2]
    if N % K:
        raise ValueError(f"query heads {N} not a multiple of kv heads {K}")
    for name, x, want in (
        ("k_ctx", k_ctx, (B, T, K, H)),
        ("v_ctx", v_ctx, (B, T, K, H)),
        ("k_blk", k_blk, (B, A, S, K, H)),
        ("v_blk", v_blk, (B, A, S, K, H)),
        ("mask.ctx_segment_ids", mask.ctx_segment_ids, (B, T)),
        ("mask.anchors", mask.anchors, (B, A)),
        ("mask.slot_positions", mask.slot_positions, (B, A, S)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want}")


def _group(q, num_kv_heads):
    """[..., N, H] -> [..., K, G, H]; head n = k * G + g, as HF's repeat_kv lays them out."""
    *lead, N, H = q.shape
    return q.reshape(*lead, num_kv_heads, N // num_kv_heads, H)


def _softmax_partial(s, vis):
    """Masked softmax pieces over the last axis: normalised probs and the row log-sum-exp."""
    s = jnp.where(vis, s, _MASKED)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / denom, (m + jnp.log(denom))[..., 0]


def merge_partials(o_a, lse_a, o_b, lse_b):
    """Combine two attentions over disjoint key sets: [..., N, H] outputs and [..., N] lse's."""
    m = jnp.maximum(lse_a, lse_b)
    w_a = jnp.exp(lse_a - m)
    w_b = jnp.exp(lse_b - m)
    out = o_a.astype(jnp.float32) * w_a[..., None] + o_b.astype(jnp.float32) * w_b[..., None]
    return out / (w_a + w_b)[..., None]


def _block_part(q, k_blk, v_blk, vis, scale):
    """Each block's slots over its own slots. vis [B, A, S, S] -> o [B,A,S,N,H] f32, lse [B,A,S,N]."""
    K = k_blk.shape[-2]
    qg = _group(q, K)
    s = jnp.einsum("BASKGH,BAPKH->BASKGP", qg, k_blk, preferred_element_type=jnp.float32) * scale
    p, lse = _softmax_partial(s, vis[:, :, :, None, None, :])
    o = jnp.einsum("BASKGP,BAPKH->BASKGH", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return _ungroup(o), _ungroup_lse(lse)


def _ungroup(o):
    *lead, K, G, H = o.shape
    return o.reshape(*lead, K * G, H)


def _ungroup_lse(lse):
    *lead, K, G = lse.shape
    return lse.reshape(*lead, K * G)


def _context_chunk(q, k_ctx, v_ctx, ctx_seg, ctx_pos, anchors, anchor_seg, slot_pos, window, scale):
    """One chunk of anchors over the whole context: o [B,Ac,S,N,H] f32, lse [B,Ac,S,N]."""
    K = k_ctx.shape[2]
    qg = _group(q, K)
    vis = context_visible(ctx_seg, ctx_pos, anchors, anchor_seg, slot_pos, window)  # [B,Ac,S,T]
    s = jnp.einsum("BASKGH,BTKH->BASKGT", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    p, lse = _softmax_partial(s, vis[:, :, :, None, None, :])
    o = jnp.einsum("BASKGT,BTKH->BASKGH", p.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    return _ungroup(o), _ungroup_lse(lse)


def context_attention_xla(q, k_ctx, v_ctx, mask: AnchoredMask, *, window, scale, chunk):
    """The context part, ``chunk`` anchors at a time; returns (o f32 [B,A,S,N,H], lse [B,A,S,N])."""
    B, A, S, N, H = q.shape
    per_anchor = (q, mask.anchors, mask.anchor_segment_ids, mask.slot_positions)

    def run(q_c, anchors_c, seg_c, pos_c):
        return _context_chunk(
            q_c,
            k_ctx,
            v_ctx,
            mask.ctx_segment_ids,
            mask.ctx_positions,
            anchors_c,
            seg_c,
            pos_c,
            window,
            scale,
        )

    if A <= chunk:
        return run(*per_anchor)
    n = -(-A // chunk)
    pad = n * chunk - A

    def split(x):  # [B, A, ...] -> [n, B, chunk, ...]; padded anchors see no context
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def merge(x):  # [n, B, chunk, ...] -> [B, A, ...]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(B, n * chunk, *x.shape[3:])[:, :A]

    o, lse = jax.lax.map(lambda xs: jax.checkpoint(run)(*xs), tuple(split(x) for x in per_anchor))
    return merge(o), merge(lse)


def reference_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask: AnchoredMask, *, causal, window, scale):
    """Dense: every slot of every block against all T context keys and all A*S slot keys."""
    B, A, S, N, H = q.shape
    T, K = k_ctx.shape[1], k_ctx.shape[2]
    k_all = jnp.concatenate([k_ctx, k_blk.reshape(B, A * S, K, H)], axis=1)
    v_all = jnp.concatenate([v_ctx, v_blk.reshape(B, A * S, K, H)], axis=1)
    ctx_vis = mask.context_visible(window).reshape(B, A * S, T)
    same_block = jnp.eye(A, dtype=bool)[None, :, None, :, None]  # [1, A, 1, A', 1]
    blk_vis = same_block & block_visible(mask.slot_positions, causal, window)[:, :, :, None, :]
    vis = jnp.concatenate([ctx_vis, blk_vis.reshape(B, A * S, A * S)], axis=-1)  # [B, Q, T + A*S]
    qg = _group(q.reshape(B, A * S, N, H), K)
    s = jnp.einsum("BQKGH,BPKH->BQKGP", qg, k_all, preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis[:, :, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("BQKGP,BPKH->BQKGH", p.astype(v_all.dtype), v_all, preferred_element_type=jnp.float32)
    return o.reshape(B, A, S, N, H).astype(q.dtype)
