"""The context part as Pallas kernels (Triton lowering): a forward, a dq and a dk/dv kernel that
visit only the context tiles a query tile can see (``tile_tables.py``) and skip the mask arithmetic on
tiles every query of the tile sees.

Layout: queries ``q [B, Q, N, H]`` with ``Q = A*S`` (slot s of block j is query ``j*S + s``),
context ``k, v [B, T, K, H]``. The forward and dq kernels run one program per (query tile, batch
row, query head) and read the K/V of head ``n // G`` in place (GQA without repeating K/V); the
dk/dv kernel runs one program per (context tile, batch row, kv head) and sums over the G query
heads of that kv head. Softmax in fp32 (online, flash style), matmuls accumulate in fp32.

Q and T are padded to whole tiles outside the kernels: padded queries have document 0 and padded
context entries document 0, so the mask hides them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.anchored_attention import budget
from pallas_kernels.anchored_attention.budget import SHARED_MEMORY_BYTES  # noqa: F401 - re-exported
from pallas_kernels.anchored_attention.common import MASKED
from pallas_kernels.anchored_attention.tile_tables import cdiv, context_tiles, query_tiles

DKDV_GROUPS = ("loop", "unroll")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes (powers of two, >= 16 for the tensor cores) and Triton launch parameters.

    ``*_bwd`` tiles are shared by the dq and the dk/dv kernel (dk/dv walks dq's tile tables
    transposed); warps and stages are per kernel. ``dkdv_groups``: how dk/dv visits the G query
    heads of its kv head: ``loop`` (one loop over (query tile, head) pairs: 2 tiles streamed per
    step) or ``unroll`` (the G heads in one loop body: 2G tiles per step; see ``budget.py``).
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    num_warps_dkdv: int = 8
    num_stages_dkdv: int = 2
    dkdv_groups: str = "loop"

    def __post_init__(self):
        if self.dkdv_groups not in DKDV_GROUPS:
            raise ValueError(f"TileConfig.dkdv_groups={self.dkdv_groups!r} must be one of {DKDV_GROUPS}")
        for name in ("num_warps", "num_warps_bwd", "num_warps_dkdv"):
            w = getattr(self, name)
            if w not in (1, 2, 4, 8, 16):
                raise ValueError(f"TileConfig.{name}={w} must be 1, 2, 4, 8 or 16")
        for name in ("num_stages", "num_stages_bwd", "num_stages_dkdv"):
            if getattr(self, name) < 1:
                raise ValueError(f"TileConfig.{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def default(cls, head_dim: int, itemsize: int = 2) -> TileConfig:
        """The defaults: 64 x 64 tiles (64 x 32 forward, 32 x 32 backward at head_dim 256), with
        the warps of a kernel doubled (up to 8) while ``budget.py`` counts it over 255 registers
        per thread (fp32 operands at head_dim 128). The H200 check of 2026-12-04 found 64 x 64 best
        in both directions at head_dim 128, bf16; ``validated.py`` records what a GPU check found."""
        if head_dim <= 128:
            t = cls()
        else:
            t = cls(block_q=64, block_k=32, num_warps=8, block_q_bwd=32, block_k_bwd=32, num_warps_bwd=8)
        warps = {"forward": "num_warps", "dq": "num_warps_bwd", "dkdv": "num_warps_dkdv"}
        for kernel, field in warps.items():
            while (
                budget.estimate(t, head_dim, 1, itemsize)[kernel].registers_per_thread
                > budget.REGISTERS_PER_THREAD
                and getattr(t, field) < 8
            ):
                t = t.replace(**{field: 2 * getattr(t, field)})
        return t

    def replace(self, **changes) -> TileConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def shared_memory_estimate(
    tiles: TileConfig, head_dim: int, itemsize: int, groups: int = 1
) -> dict[str, int]:
    """Bytes of shared memory per kernel (``budget.estimate``)."""
    return {k: b.shared_bytes for k, b in budget.estimate(tiles, head_dim, groups, itemsize).items()}


def check_tiles(tiles: TileConfig, head_dim: int, itemsize: int, groups: int = 1) -> None:
    """Raise ValueError for tiles the kernels cannot use or that are over ``budget.py``'s limits."""
    for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
        b = getattr(tiles, name)
        if b < 16 or b & (b - 1):
            raise ValueError(f"TileConfig.{name}={b} must be a power of two >= 16")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the Pallas kernel")
    budget.check(tiles, head_dim, groups, itemsize)


def _dot(a, b, *, contract_a=1, contract_b=0):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def _visible(q_anchor, q_seg, q_pos, c_seg, c_pos, start, window):
    """[bq, bk] bool for the context tile beginning at entry ``start`` (see mask.py)."""
    idx = start + jax.lax.broadcasted_iota(jnp.int32, (1, c_seg.shape[0]), 1)
    vis = (c_seg[None, :] == q_seg[:, None]) & (q_seg[:, None] != 0) & (idx < q_anchor[:, None])
    if window is not None:
        vis = vis & (q_pos[:, None] - c_pos[None, :] < window)
    return vis


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    window: int | None
    slots: int
    tiles: TileConfig
    interpret: bool


def _launch(st: _Static, kernel: str):
    t = st.tiles
    if st.interpret:
        return {"interpret": True}
    warps, stages = {
        "forward": (t.num_warps, t.num_stages),
        "dq": (t.num_warps_bwd, t.num_stages_bwd),
        "dkdv": (t.num_warps_dkdv, t.num_stages_dkdv),
    }[kernel]
    return {"compiler_params": pl_triton.CompilerParams(num_warps=warps, num_stages=stages)}


# ------------------------------------------------------------------------------------------ forward


def _fwd_kernel(
    lo_ref, f0_ref, f1_ref, hi_ref, q_ref, k_ref, v_ref, qa_ref, qs_ref, qp_ref, cs_ref, cp_ref,
    o_ref, lse_ref, *, scale, window, block_k,
):  # fmt: skip
    q = q_ref[...]
    q_anchor, q_seg, q_pos = qa_ref[...], qs_ref[...], qp_ref[...]
    bq, H = q.shape

    def step(j, carry, masked):
        acc, m, denom = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = _dot(q, k, contract_b=1) * scale
        if masked:
            c_seg, c_pos = cs_ref[pl.ds(start, block_k)], cp_ref[pl.ds(start, block_k)]
            vis = _visible(q_anchor, q_seg, q_pos, c_seg, c_pos, start, window)
            s = jnp.where(vis, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        if masked:  # a row with nothing visible yet has m_new == MASKED and exp(0) == 1 here
            p = jnp.where(vis, p, 0.0)
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, denom

    carry = (
        jnp.zeros((bq, H), jnp.float32),
        jnp.full((bq,), MASKED, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    lo, f0, f1, hi = lo_ref[0], f0_ref[0], f1_ref[0], hi_ref[0]
    carry = jax.lax.fori_loop(lo, f0, functools.partial(step, masked=True), carry)
    carry = jax.lax.fori_loop(f0, f1, functools.partial(step, masked=False), carry)
    acc, m, denom = jax.lax.fori_loop(f1, hi, functools.partial(step, masked=True), carry)
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, MASKED, m + jnp.log(safe))


def _forward(st: _Static, q, k, v, meta):
    """q [B,Qp,N,H], k/v [B,Tp,K,H] -> o f32 [B,Qp,N,H], lse f32 [B,N,Qp]."""
    B, Qp, N, H = q.shape
    Tp, K = k.shape[1], k.shape[2]
    G = N // K
    t = st.tiles
    bq = t.block_q
    qt = meta["fwd_tables"]
    table = pl.BlockSpec((None, 1), lambda i, b, n: (b, i))
    per_query = pl.BlockSpec((None, bq), lambda i, b, n: (b, i))
    per_ctx = pl.BlockSpec((None, Tp), lambda i, b, n: (b, 0))
    kv = pl.BlockSpec((None, Tp, None, H), lambda i, b, n: (b, 0, n // G, 0))
    kernel = functools.partial(_fwd_kernel, scale=st.scale, window=st.window, block_k=t.block_k)
    return pl.pallas_call(
        kernel,
        grid=(Qp // bq, B, N),
        in_specs=[table] * 4
        + [pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0)), kv, kv]
        + [per_query] * 3
        + [per_ctx] * 2,
        out_specs=[
            pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Qp, N, H), jnp.float32),
            jax.ShapeDtypeStruct((B, N, Qp), jnp.float32),
        ],
        name="anchored_context_attention_fwd",
        **_launch(st, "forward"),
    )(*qt, q, k, v, meta["q_anchor"], meta["q_seg"], meta["q_pos"], meta["c_seg"], meta["c_pos"])


# ----------------------------------------------------------------------------------------- backward


def _dq_kernel(
    lo_ref, f0_ref, f1_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    qa_ref, qs_ref, qp_ref, cs_ref, cp_ref, dq_ref, *, scale, window, block_k,
):  # fmt: skip
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_anchor, q_seg, q_pos = qa_ref[...], qs_ref[...], qp_ref[...]

    def step(j, dq, masked):
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        p = jnp.exp(_dot(q, k, contract_b=1) * scale - lse[:, None])
        if masked:
            c_seg, c_pos = cs_ref[pl.ds(start, block_k)], cp_ref[pl.ds(start, block_k)]
            p = jnp.where(_visible(q_anchor, q_seg, q_pos, c_seg, c_pos, start, window), p, 0.0)
        ds = p * (_dot(do, v, contract_b=1) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, jnp.float32)
    lo, f0, f1, hi = lo_ref[0], f0_ref[0], f1_ref[0], hi_ref[0]
    dq = jax.lax.fori_loop(lo, f0, functools.partial(step, masked=True), dq)
    dq = jax.lax.fori_loop(f0, f1, functools.partial(step, masked=False), dq)
    dq = jax.lax.fori_loop(f1, hi, functools.partial(step, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    i_lo_ref, g0_ref, g1_ref, i_hi_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref,
    qa_ref, qs_ref, qp_ref, cs_ref, cp_ref, dk_ref, dv_ref, *, scale, window, block_q, groups, unroll,
):  # fmt: skip
    k, v = k_ref[...], v_ref[...]
    c_seg, c_pos = cs_ref[...], cp_ref[...]
    start_k = pl.program_id(0) * k.shape[0]

    def visible(start):
        q_rows = pl.ds(start, block_q)
        return _visible(qa_ref[q_rows], qs_ref[q_rows], qp_ref[q_rows], c_seg, c_pos, start_k, window)

    def head(start, g, vis, carry):  # one query tile of one query head g of this kv head
        dk, dv = carry
        q = q_ref[pl.ds(start, block_q), g, :]
        do = do_ref[pl.ds(start, block_q), g, :]
        lse = lse_ref[g, pl.ds(start, block_q)]
        delta = delta_ref[g, pl.ds(start, block_q)]
        p = jnp.exp(_dot(q, k, contract_b=1) * scale - lse[:, None])
        if vis is not None:
            p = jnp.where(vis, p, 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, contract_a=0)
        ds = p * (_dot(do, v, contract_b=1) - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, contract_a=0)
        return dk, dv

    def tile_all_heads(i, carry, masked):  # "unroll": the G heads in one body (2G tiles per step)
        start = pl.multiple_of(i * block_q, block_q)
        vis = visible(start) if masked else None
        for g in range(groups):
            carry = head(start, g, vis, carry)
        return carry

    def tile_head(u, carry, masked):  # "loop": step u is query tile u // G, head u % G (2 tiles)
        start = pl.multiple_of((u // groups) * block_q, block_q)
        return head(start, u % groups, visible(start) if masked else None, carry)

    step, per = (tile_all_heads, 1) if unroll else (tile_head, groups)
    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    i_lo, g0, g1, i_hi = i_lo_ref[0] * per, g0_ref[0] * per, g1_ref[0] * per, i_hi_ref[0] * per
    carry = jax.lax.fori_loop(i_lo, g0, functools.partial(step, masked=True), carry)
    carry = jax.lax.fori_loop(g0, g1, functools.partial(step, masked=False), carry)
    dk, dv = jax.lax.fori_loop(g1, i_hi, functools.partial(step, masked=True), carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_delta(o, do, dlse):
    """delta [B,N,Qp] = rowsum(o * do) - dlse: d lse / d s = p, so an lse cotangent enters like a
    shift of delta."""
    return jnp.einsum("BQNH,BQNH->BNQ", o, do.astype(jnp.float32)) - dlse


def dq_call(st: _Static, q, k, v, meta, do, lse, delta):
    """The dq kernel: q/do [B,Qp,N,H], lse/delta [B,N,Qp] -> dq f32 [B,Qp,N,H] (scale applied)."""
    B, Qp, N, H = q.shape
    Tp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.tiles.block_q_bwd, st.tiles.block_k_bwd
    table = pl.BlockSpec((None, 1), lambda i, b, n: (b, i))
    q_tile = pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0))
    row_tile = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
    kv_all = pl.BlockSpec((None, Tp, None, H), lambda i, b, n: (b, 0, n // G, 0))
    return pl.pallas_call(
        functools.partial(_dq_kernel, scale=st.scale, window=st.window, block_k=bk),
        grid=(Qp // bq, B, N),
        in_specs=[table] * 4
        + [q_tile, kv_all, kv_all, q_tile, row_tile, row_tile]
        + [pl.BlockSpec((None, bq), lambda i, b, n: (b, i))] * 3
        + [pl.BlockSpec((None, Tp), lambda i, b, n: (b, 0))] * 2,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        name="anchored_context_attention_dq",
        **_launch(st, "dq"),
    )(*meta["bwd_tables"], q, k, v, do, lse, delta, *_query_meta(meta), *_ctx_meta(meta))


def dkdv_call(st: _Static, q, k, v, meta, do, lse, delta):
    """The dk/dv kernel: one program per (context tile, row, kv head), summing its G query heads
    (axis 3 of the [B,Qp,K,G,H] view of q) -> dk, dv f32 [B,Tp,K,H]."""
    B, Qp, N, H = q.shape
    Tp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.tiles.block_q_bwd, st.tiles.block_k_bwd
    q5 = q.reshape(B, Qp, K, G, H)
    do5 = do.reshape(B, Qp, K, G, H)
    lse4 = lse.reshape(B, K, G, Qp)
    delta4 = delta.reshape(B, K, G, Qp)
    kv_tile = pl.BlockSpec((None, bk, None, H), lambda j, b, h: (b, j, h, 0))
    q_all = pl.BlockSpec((None, Qp, None, G, H), lambda j, b, h: (b, 0, h, 0, 0))
    row_all = pl.BlockSpec((None, None, G, Qp), lambda j, b, h: (b, h, 0, 0))
    kernel = functools.partial(
        _dkdv_kernel, scale=st.scale, window=st.window, block_q=bq, groups=G,
        unroll=st.tiles.dkdv_groups == "unroll",
    )  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=(Tp // bk, B, K),
        in_specs=[pl.BlockSpec((None, 1), lambda j, b, h: (b, j))] * 4
        + [kv_tile, kv_tile, q_all, q_all, row_all, row_all]
        + [pl.BlockSpec((None, Qp), lambda j, b, h: (b, 0))] * 3
        + [pl.BlockSpec((None, bk), lambda j, b, h: (b, j))] * 2,
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, jnp.float32)] * 2,
        name="anchored_context_attention_dkdv",
        **_launch(st, "dkdv"),
    )(*meta["ctx_tables"], k, v, q5, do5, lse4, delta4, *_query_meta(meta), *_ctx_meta(meta))


def _query_meta(meta):
    return meta["q_anchor"], meta["q_seg"], meta["q_pos"]


def _ctx_meta(meta):
    return meta["c_seg"], meta["c_pos"]


def _backward(st: _Static, q, k, v, meta, o, lse, do, dlse):
    delta = backward_delta(o, do, dlse)
    do = do.astype(q.dtype)
    dq = dq_call(st, q, k, v, meta, do, lse, delta)
    dk, dv = dkdv_call(st, q, k, v, meta, do, lse, delta)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ------------------------------------------------------------------------------------------- vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: _Static, q, k, v, meta):
    return _forward(st, q, k, v, meta)


def _attend_fwd(st, q, k, v, meta):
    o, lse = _forward(st, q, k, v, meta)
    return (o, lse), (q, k, v, meta, o, lse)


def _attend_bwd(st, res, cot):
    q, k, v, meta, o, lse = res
    do, dlse = cot
    dq, dk, dv = _backward(st, q, k, v, meta, o, lse, do, dlse)
    return dq, dk, dv, jax.tree.map(lambda _: None, meta)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _pad_axis(x, axis, size, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def prepare(
    ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions, *, tiles: TileConfig, window
):
    """Padded per-query/per-context mask arrays and the tile tables for forward and backward."""
    B, T = ctx_segment_ids.shape
    A, S = slot_positions.shape[1:]
    Q = A * S
    q_mult = max(tiles.block_q, tiles.block_q_bwd)
    k_mult = max(tiles.block_k, tiles.block_k_bwd)
    Qp, Tp = cdiv(Q, q_mult) * q_mult, cdiv(T, k_mult) * k_mult
    i32 = jnp.int32
    meta = {
        "q_anchor": _pad_axis(jnp.repeat(anchors.astype(i32), S, axis=1), 1, Qp),
        "q_seg": _pad_axis(jnp.repeat(anchor_segment_ids.astype(i32), S, axis=1), 1, Qp),
        "q_pos": _pad_axis(slot_positions.astype(i32).reshape(B, Q), 1, Qp),
        "c_seg": _pad_axis(ctx_segment_ids.astype(i32), 1, Tp),
        "c_pos": _pad_axis(ctx_positions.astype(i32), 1, Tp),
    }
    tabs = functools.partial(
        query_tiles, ctx_segment_ids, anchors, anchor_segment_ids, slots=S, window=window
    )
    meta["fwd_tables"] = tabs(block_q=tiles.block_q, block_k=tiles.block_k, n_q_tiles=Qp // tiles.block_q)
    bwd = tabs(block_q=tiles.block_q_bwd, block_k=tiles.block_k_bwd, n_q_tiles=Qp // tiles.block_q_bwd)
    meta["bwd_tables"] = bwd
    meta["ctx_tables"] = context_tiles(bwd, Tp // tiles.block_k_bwd)
    return meta, Qp, Tp


def kernel_inputs(q, k, v, mask, *, window, scale, interpret, tiles: TileConfig | None):
    """The padded operands of the three kernels, for calling them one at a time (the GPU check
    compiles forward, dq and dk/dv separately so that a failure names its kernel):
    ``(st, q_rows [B,Qp,N,H], k [B,Tp,K,H], v, meta)``."""
    B, A, S, N, H = q.shape
    K = k.shape[2]
    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = TileConfig.default(H, itemsize) if tiles is None else tiles
    check_tiles(tiles, H, itemsize, groups=N // K)
    meta, Qp, Tp = prepare(*mask, tiles=tiles, window=window)
    st = _Static(scale=float(scale), window=window, slots=S, tiles=tiles, interpret=interpret)
    q_rows = _pad_axis(q.reshape(B, A * S, N, H), 1, Qp)
    return st, q_rows, _pad_axis(k, 1, Tp), _pad_axis(v, 1, Tp), meta


forward_call = _forward


def context_attention_pallas(
    q,
    k,
    v,
    ctx_segment_ids,
    ctx_positions,
    anchors,
    anchor_segment_ids,
    slot_positions,
    *,
    window,
    scale,
    interpret: bool = False,
    tiles: TileConfig | None = None,
):
    """q [B,A,S,N,H], k/v [B,T,K,H] -> (out f32 [B,A,S,N,H], lse f32 [B,A,S,N]), differentiable."""
    B, A, S, N, H = q.shape
    mask = (ctx_segment_ids, ctx_positions, anchors, anchor_segment_ids, slot_positions)
    st, q_rows, k_p, v_p, meta = kernel_inputs(
        q, k, v, mask, window=window, scale=scale, interpret=interpret, tiles=tiles
    )
    o, lse = _attend(st, q_rows, k_p, v_p, meta)
    o = o[:, : A * S].reshape(B, A, S, N, H)
    lse = jnp.swapaxes(lse[:, :, : A * S], 1, 2).reshape(B, A, S, N)
    return o, lse
