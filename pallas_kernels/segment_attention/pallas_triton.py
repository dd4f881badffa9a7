"""The target's causal packed-segment attention as one Pallas forward kernel (Triton lowering).

One program per (query tile, batch row, query head) reads the K/V of kv head ``n // G`` in place
(GQA without repeating K/V) and walks the key tiles its tile table names (``tile_tables``) with an
online softmax in fp32; matmuls accumulate in fp32, inputs stay in their dtype (bf16 on a GPU).
Forward only: the target is frozen, and nothing differentiates through it.

T and S are padded to whole tiles outside the kernel: padded queries sit at index -1 with a segment
no key has, padded keys carry a segment no query has, so the mask hides both and a query that sees
nothing writes zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.anchored_attention.budget import (
    REGISTER_OVERHEAD,
    REGISTERS_PER_THREAD,
    SHARED_MEMORY_BYTES,
    KernelBudget,
)
from pallas_kernels.padding import pad_axis1 as _pad_axis1
from pallas_kernels.segment_attention.reference import MASKED
from pallas_kernels.segment_attention.tile_tables import PAD_KEY_SEGMENT, PAD_QUERY_SEGMENT, tile_tables


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes (powers of two, >= 16 for the tensor cores) and Triton launch parameters.

    The defaults are the drafter kernel's measured forward tiles (BENCHMARKS.md, the H200 sweep:
    64 x 64, 4 warps, 3 stages best at head_dim 128, bf16); this kernel's own tiles are not yet
    measured on a GPU: ``scripts/gpu_check.py``'s ``target`` stage times them.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if b < 16 or b & (b - 1):
                raise ValueError(f"segment_attention TileConfig.{name}={b} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"segment_attention TileConfig.num_warps={self.num_warps} must be 1, 2, 4, 8 or 16"
            )
        if self.num_stages < 1:
            raise ValueError(f"segment_attention TileConfig.num_stages={self.num_stages} must be >= 1")

    @classmethod
    def default(cls, head_dim: int, itemsize: int = 2) -> TileConfig:
        """64 x 64 tiles, 4 warps, 3 stages, then, while ``estimate`` counts it over one block's
        budget: more warps (up to 8) against register spills, fewer stages, then smaller key tiles
        (fp32 or head_dim 256)."""
        t = cls()
        while t.num_warps < 8 and estimate(t, head_dim, itemsize).registers_per_thread > REGISTERS_PER_THREAD:
            t = t.replace(num_warps=2 * t.num_warps)
        while estimate(t, head_dim, itemsize).problems() and t.num_stages > 2:
            t = t.replace(num_stages=t.num_stages - 1)
        while estimate(t, head_dim, itemsize).problems() and t.block_k > 16:
            t = t.replace(block_k=t.block_k // 2)
        return t

    def replace(self, **changes) -> TileConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def estimate(tiles: TileConfig, head_dim: int, itemsize: int) -> KernelBudget:
    """What one program holds (the drafter kernel's budget model, ``anchored_attention/budget.py``):
    streamed k, v tiles and key segments; the resident q tile and per-query arrays; p as scratch."""
    H, bq, bk, i32 = head_dim, tiles.block_q, tiles.block_k, 4
    fp32_values = bq * H + 2 * bq * bk  # acc [bq, H]; s and p [bq, bk]
    operand_bytes = bq * H * itemsize
    return KernelBudget(
        "forward",
        streamed_bytes=2 * bk * H * itemsize + bk * i32,
        stages=tiles.num_stages,
        resident_bytes=bq * H * itemsize + 2 * bq * i32,
        scratch_bytes=bq * bk * itemsize,
        registers_per_thread=-(-(fp32_values + operand_bytes // 4) // (32 * tiles.num_warps))
        + REGISTER_OVERHEAD,
    )


def check_tiles(tiles: TileConfig, head_dim: int, itemsize: int) -> None:
    """Raise ValueError for a head_dim the kernel cannot take or tiles over one H100/H200 block."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the segment attention kernel")
    problems = estimate(tiles, head_dim, itemsize).problems(SHARED_MEMORY_BYTES)
    if problems:
        raise ValueError(
            f"segment_attention tiles {tiles} do not fit one H100/H200 block at head_dim={head_dim}, "
            f"itemsize={itemsize}: {' and '.join(problems)}"
        )


def _dot(a, b, *, contract_b=0):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _kernel(
    lo_ref, f0_ref, f1_ref, hi_ref, q_ref, k_ref, v_ref, qi_ref, qs_ref, ks_ref, seg_lo_ref, seg_hi_ref,
    o_ref, *, scale, block_k,
):  # fmt: skip
    q = q_ref[...]
    q_index, q_seg = qi_ref[...], qs_ref[...]
    q_seg_lo, q_seg_hi = jnp.min(q_seg), jnp.max(q_seg)
    bq, H = q.shape

    def step(j, carry, masked):
        acc, m, denom = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = _dot(q, k, contract_b=1) * scale
        if masked:
            k_seg = ks_ref[pl.ds(start, block_k)]
            k_index = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            vis = (k_index <= q_index[:, None]) & (k_seg[None, :] == q_seg[:, None])
            s = jnp.where(vis, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        if masked:  # a row with nothing visible yet has m_new == MASKED and exp(0) == 1 here
            p = jnp.where(vis, p, 0.0)
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, denom

    def masked_step(j, carry):  # a tile whose segment range misses the query tile's is skipped
        overlaps = (seg_hi_ref[j] >= q_seg_lo) & (seg_lo_ref[j] <= q_seg_hi)
        return jax.lax.cond(overlaps, functools.partial(step, masked=True), lambda j, c: c, j, carry)

    carry = (
        jnp.zeros((bq, H), jnp.float32),
        jnp.full((bq,), MASKED, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    lo, f0, f1, hi = lo_ref[0], f0_ref[0], f1_ref[0], hi_ref[0]
    carry = jax.lax.fori_loop(lo, f0, masked_step, carry)
    carry = jax.lax.fori_loop(f0, f1, functools.partial(step, masked=False), carry)
    acc, _, denom = jax.lax.fori_loop(f1, hi, masked_step, carry)
    safe = jnp.where(denom == 0.0, 1.0, denom)
    o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)


def segment_attention_pallas(
    q, k, v, q_index, q_segment, kv_segment, *, scale: float, tiles: TileConfig | None = None,
    interpret: bool = False,
):  # fmt: skip
    """q [B,T,N,H], k/v [B,S,K,H] (N a multiple of K), q_index/q_segment [B,T], kv_segment [B,S]
    -> [B,T,N,H] in q's dtype: query t sees key s iff ``s <= q_index[t]`` and the segments match."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = TileConfig.default(H, itemsize) if tiles is None else tiles
    check_tiles(tiles, H, itemsize)
    bq, bk = tiles.block_q, tiles.block_k
    q_p = _pad_axis1(q, bq, 0)
    qi = _pad_axis1(q_index.astype(jnp.int32), bq, -1)
    qs = _pad_axis1(q_segment.astype(jnp.int32), bq, PAD_QUERY_SEGMENT)
    k_p, v_p = _pad_axis1(k, bk, 0), _pad_axis1(v, bk, 0)
    ks = _pad_axis1(kv_segment.astype(jnp.int32), bk, PAD_KEY_SEGMENT)
    Tp, Sp = q_p.shape[1], k_p.shape[1]
    tables = tile_tables(qi, qs, ks, block_q=bq, block_k=bk)

    table = pl.BlockSpec((None, 1), lambda i, b, n: (b, i))
    q_tile = pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0))
    kv_row = pl.BlockSpec((None, Sp, None, H), lambda i, b, n: (b, 0, n // G, 0))
    per_query = pl.BlockSpec((None, bq), lambda i, b, n: (b, i))
    key_row = pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0))
    key_tiles = pl.BlockSpec((None, Sp // bk), lambda i, b, n: (b, 0))
    launch = (
        {"interpret": True}
        if interpret
        else {
            "compiler_params": pl_triton.CompilerParams(
                num_warps=tiles.num_warps, num_stages=tiles.num_stages
            )
        }
    )
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block_k=bk),
        grid=(Tp // bq, B, N),
        in_specs=[table] * 4 + [q_tile, kv_row, kv_row, per_query, per_query, key_row, key_tiles, key_tiles],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct((B, Tp, N, H), q.dtype),
        name="segment_attention_fwd",
        **launch,
    )(*tables.query, q_p, k_p, v_p, qi, qs, ks, *tables.key_segments)
    return out[:, :T]
