"""Anchored block attention: block queries over ``[context ; own block]`` keys.

Shapes (named in einsums): B batch, A anchors (blocks), S slots per block, T context length,
N query heads = K kv heads x G group, H head_dim.

  q      [B, A, S, N, H]   slot queries (q-normed, roped)
  k_ctx  [B, T, K, H]      context keys (k-normed, roped), v_ctx likewise
  k_blk  [B, A, S, K, H]   each block's own keys, v_blk likewise
  out    [B, A, S, N, H]

The context part (slots over the T context entries) is the kernel seam:
``pallas_kernels.anchored_attention.context_attention`` returns its ``(out, lse)`` with
``impl = auto | pallas | xla | reference`` (see that package). The in-block part is a tiny
``[S, S]`` attention per block; the two are merged by their log-sum-exps here.

On a mesh the kernels run per device under ``shard_map`` (``Partition``): rows over the mesh axes
of the ``batch`` rule, kv-head groups over those of ``act_kv_heads`` (sharding.py), the layout
the activations already have, so no device gathers another's q/k/v.

``impl="reference"`` instead runs one dense softmax over all ``[T + A*S]`` keys with the full mask
(memory ``A*S x (T + A*S)``): the obviously correct whole, against which tests check the merge.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.drafter.masks import AnchoredMask, block_visible
from dflash_jax.sharding import mesh_axes
from pallas_kernels.anchored_attention import Partition, context_attention
from pallas_kernels.anchored_attention.common import check_shapes, group, masked_softmax, ungroup


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
    impl: str = "auto",
    anchor_chunk: int = 16,
    scale: float | None = None,
    **kernel_options,
) -> jax.Array:
    """Attention of every block's slots over its visible context and its own block (see module doc).

    ``kernel_options`` go to ``context_attention`` (``interpret``, ``backward``, ``tiles``,
    ``partition``: default the sharding rules' row and kv-head axes)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_shapes(q, k_ctx, v_ctx, k_blk, v_blk, mask)
    if impl == "reference":
        return reference_attention(
            q, k_ctx, v_ctx, k_blk, v_blk, mask, causal=causal, window=window, scale=scale
        )
    o_blk, lse_blk = _block_part(q, k_blk, v_blk, mask.block_visible(causal, window), scale)
    kernel_options.setdefault(
        "partition", Partition(rows=mesh_axes("batch"), heads=mesh_axes("act_kv_heads"))
    )
    o_ctx, lse_ctx = context_attention(
        q, k_ctx, v_ctx, *mask, window=window, scale=scale, impl=impl, chunk=anchor_chunk, **kernel_options
    )
    return merge_partials(o_ctx, lse_ctx, o_blk, lse_blk).astype(q.dtype)


def _check_shapes(q, k_ctx, v_ctx, k_blk, v_blk, mask):
    check_shapes(q, k_ctx, v_ctx, *mask)
    B, A, S, N, H = q.shape
    K = k_ctx.shape[2]
    for name, x in (("k_blk", k_blk), ("v_blk", v_blk)):
        if tuple(x.shape) != (B, A, S, K, H):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {(B, A, S, K, H)}")


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
    s = jnp.einsum("BASKGH,BAPKH->BASKGP", group(q, K), k_blk, preferred_element_type=jnp.float32) * scale
    p, lse = masked_softmax(s, vis[:, :, :, None, None, :])
    o = jnp.einsum("BASKGP,BAPKH->BASKGH", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return ungroup(o, 1), ungroup(lse, 0)


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
    qg = group(q.reshape(B, A * S, N, H), K)
    s = jnp.einsum("BQKGH,BPKH->BQKGP", qg, k_all, preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis[:, :, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("BQKGP,BPKH->BQKGH", p.astype(v_all.dtype), v_all, preferred_element_type=jnp.float32)
    return o.reshape(B, A, S, N, H).astype(q.dtype)
