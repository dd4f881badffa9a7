"""Mixture-of-experts MLP blocks of the target: routing, dropless grouped expert matmuls, and
expert parallelism on the mesh.

Routing (per token, as transformers computes it, ties included: ``lax.top_k`` and ``torch.topk``
both put the lower expert index first among equal scores):

* ``qwen3_moe`` / ``qwen3_5_moe``: probs = softmax(x W_r) in fp32, top-k of the probs, optionally
  renormalised to sum to 1 (``norm_topk_prob``; always on for qwen3_5_moe).
* ``gpt_oss``: logits = x W_r + b_r, top-k of the logits, softmax over those k.

Experts are dropless: every (token, choice) pair is computed, with no capacity factor. The pairs
are sorted by expert and each expert's contiguous run of rows is multiplied by that expert's
weights with one grouped matmul, then weighted and scatter-added back to their tokens. Two
implementations (``TargetConfig.moe_matmul``): ``ragged_dot`` (``jax.lax.ragged_dot``, a real
grouped matmul on TPU; the CPU backend, and by default XLA:GPU as reported, expand it into a dense
dot over every local expert, E_local x the FLOPs and an [E_local, R, D] buffer) and ``tiled`` (each
expert's rows padded to tiles of ``moe_tile`` rows, a loop over the tiles in use: the routed FLOPs
plus padding and O(R) temporaries on any backend, forward only). ``auto`` (the default) picks
``ragged_dot`` on TPU and ``tiled`` elsewhere, so plans on CPU and runs on GPUs get the tiled one. Expert MLPs: SwiGLU (Qwen), or gpt-oss's clamped form with biases
(gate <= limit, -limit <= up <= limit, out = (up + 1) * gate * sigmoid(alpha * gate)).

Expert parallelism: the stacked expert weights [E, ...] carry the logical axis ``experts``,
which the sharding rules map onto ``fsdp`` x ``tensor`` (see docs/mesh.md for why), so each
device of that group holds E / (fsdp * tensor) whole experts. Inside a ``shard_map`` each device
all-gathers the tokens of its ``fsdp`` group (the batch is split over ``fsdp``, not over
``tensor``), computes the pairs routed to its own experts, and the partial outputs are
reduce-scattered back over ``fsdp`` and summed over ``tensor``. Routing itself (and the load
metric) runs outside, sharded like any other activation. Without a mesh, or when the experts do not
divide the axes (the planner refuses such a layout; a direct forward falls back to replicated
experts), everything runs locally.

The router's load (tokens routed to each expert, per MoE layer) comes back as a metric of the
target forward (``TargetOutput.expert_load``); it is never a loss: the target is frozen.

Dimension names: B batch, T length, D model width, E experts, k experts per token, F expert width,
M tokens, R = M * k routed rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.layers import swiglu_mlp
from dflash_jax.sharding import _current_mesh

EXPERT_MESH_AXES = ("fsdp", "tensor")  # what the ``experts`` logical axis maps to
BATCH_MESH_AXES = ("data", "fsdp")  # what ``batch`` maps to (sharding.DEFAULT_RULES)


def moe_param_specs(c) -> dict[str, tuple[tuple[int, ...], tuple, str]]:
    """name -> (per-layer shape, logical axes, init) of one MoE block."""
    D, E, F = c.hidden_size, c.num_experts, c.moe_intermediate_size
    specs = {
        "router": ((D, E), ("embed", None), "normal"),
        "gate": ((E, D, F), ("experts", "embed", "mlp"), "normal"),
        "up": ((E, D, F), ("experts", "embed", "mlp"), "normal"),
        "down": ((E, F, D), ("experts", "mlp", "embed"), "normal"),
    }
    if c.expert_biases:
        specs.update(
            router_bias=((E,), (None,), "zeros"),
            gate_bias=((E, F), ("experts", None), "zeros"),
            up_bias=((E, F), ("experts", None), "zeros"),
            down_bias=((E, D), ("experts", None), "zeros"),
        )
    if c.shared_expert_intermediate_size:
        S = c.shared_expert_intermediate_size
        specs.update(
            shared_gate=((D, S), ("embed", "mlp"), "normal"),
            shared_up=((D, S), ("embed", "mlp"), "normal"),
            shared_down=((S, D), ("mlp", "embed"), "normal"),
            shared_expert_gate=((D, 1), ("embed", None), "normal"),
        )
    return specs


# ---- routing ------------------------------------------------------------------------------------


def route(x: jax.Array, p: dict, c) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (weights [..., k] in x's dtype, expert ids [..., k] int32), as transformers."""
    logits = jnp.einsum("...D,DE->...E", x, p["router"].astype(x.dtype))
    k = c.num_experts_per_tok
    if c.model_type == "gpt_oss":
        logits = logits + p["router_bias"].astype(x.dtype)
        top, idx = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), idx.astype(jnp.int32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    if c.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), idx.astype(jnp.int32)


def expert_load(idx: jax.Array, num_experts: int) -> jax.Array:
    """[E] int32: how many (token, choice) pairs chose each expert."""
    return jnp.zeros((num_experts,), jnp.int32).at[idx.reshape(-1)].add(1)


# ---- experts ------------------------------------------------------------------------------------


def _activation(g, u, c):
    if c.swiglu_limit > 0:  # gpt-oss
        g = jnp.minimum(g, c.swiglu_limit)
        u = jnp.clip(u, -c.swiglu_limit, c.swiglu_limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * c.swiglu_alpha))
    return jax.nn.silu(g) * u


def moe_matmul_impl(c) -> str:
    """The grouped-matmul implementation ``c.moe_matmul`` names, ``auto`` resolved: ``ragged_dot``
    on TPU (lowered to a real grouped matmul there), ``tiled`` elsewhere: the CPU backend, and by
    default XLA:GPU (as reported, see docs/mesh.md), expand ``ragged_dot`` into a dense dot over
    every local expert with the other experts' rows masked: E_local x the FLOPs and an
    [E_local, rows, D] buffer per projection."""
    impl = getattr(c, "moe_matmul", "auto")
    if impl == "auto":
        return "ragged_dot" if jax.default_backend() == "tpu" else "tiled"
    return impl


def grouped_experts(x, weights, idx, p, c, first_expert=0):
    """The routed experts over local tokens: x [M, D], weights / idx [M, k] -> [M, D].

    Only experts first_expert .. first_expert + E_local - 1 (E_local = p["gate"].shape[0]) are
    computed here; pairs routed elsewhere contribute zero (another device computes them). The
    grouped matmul is ``c.moe_matmul``'s (``moe_matmul_impl``)."""
    n_local = p["gate"].shape[0]
    rel = idx.reshape(-1) - first_expert  # [R]
    mine = (rel >= 0) & (rel < n_local)
    key = jnp.where(mine, rel, n_local)  # pairs of other devices' experts sort last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((n_local + 1,), jnp.int32).at[key].add(1)[:n_local]
    token = (jnp.arange(idx.size, dtype=jnp.int32) // idx.shape[-1])[order]
    w = jnp.where(mine, weights.reshape(-1), 0)[order].astype(x.dtype)
    if moe_matmul_impl(c) == "tiled":
        return _tiled_experts(x, token, w, sizes, p, c)
    return _ragged_dot_experts(x, token, w, key[order], sizes, p, c)


def _ragged_dot_experts(x, token, w, expert, sizes, p, c):
    """Sorted pairs (token [R], weight w [R], local expert [R], E_local for other devices' pairs,
    which sort last) through three ``ragged_dot`` calls."""
    M, D = x.shape
    n_local = p["gate"].shape[0]
    rows = x[token]  # [R, D], grouped by expert
    dt = x.dtype
    g = jax.lax.ragged_dot(rows, p["gate"].astype(dt), sizes)
    u = jax.lax.ragged_dot(rows, p["up"].astype(dt), sizes)
    if "gate_bias" in p:
        e = jnp.minimum(expert, n_local - 1)
        g = g + p["gate_bias"].astype(dt)[e]
        u = u + p["up_bias"].astype(dt)[e]
    y = jax.lax.ragged_dot(_activation(g, u, c), p["down"].astype(dt), sizes)
    if "down_bias" in p:
        y = y + p["down_bias"].astype(dt)[e]
    return jnp.zeros((M, D), jnp.float32).at[token].add((y * w[:, None]).astype(jnp.float32)).astype(dt)


def tile_rows(rows: int, num_experts: int, tile: int) -> int:
    """Rows per tile for ``rows`` routed rows over ``num_experts`` experts: ``tile``, or the largest
    power of two <= the rows per expert when that is less (decoding), so the padding (at most
    E_local x (tile - 1) rows, E_local <= num_experts) never outgrows the rows themselves."""
    per_expert = max(1, rows // max(num_experts, 1))
    return max(1, min(tile, 1 << (per_expert.bit_length() - 1)))


def _tiled_experts(x, token, w, sizes, p, c):
    """Sorted pairs through a grouped matmul of tiles: each expert's run of rows is padded up to a
    multiple of m rows, so every tile of m rows belongs to one expert, and a loop over the tiles in
    use multiplies each by its expert's weights, read with a dynamic index (never a gather of
    weights per tile). Its trip count is data-dependent (a ``while`` loop), so the work is that of
    the rows routed here plus at most E_local x (m - 1) padding rows, and the temporaries are
    O(rows) indices, the [M, D] fp32 sum and one tile's [m, F] activations.

    Forward only (reverse-mode differentiation of a data-dependent loop is unsupported): the
    target is frozen and the train step never differentiates through it."""
    M, D = x.shape
    R = token.shape[0]
    n_local = p["gate"].shape[0]
    m = tile_rows(R, c.num_experts, c.moe_tile)  # global E: the same tiles on one device or many
    n_tiles = min(R, (R + n_local * (m - 1)) // m)  # static bound on the tiles in use
    tiles = (sizes + m - 1) // m  # [E_local] tiles per expert
    tile_end = jnp.cumsum(tiles)
    used = tile_end[-1]
    row_start = jnp.cumsum(sizes) - sizes  # first sorted row of each expert
    slot_start = (tile_end - tiles) * m  # its first padded slot
    # Sorted row j -> padded slot; rows of other devices' experts (j >= sum(sizes)) are dropped.
    rank = jnp.arange(R, dtype=jnp.int32)
    e_of_row = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), rank, side="right"), n_local - 1)
    slot = jnp.where(rank < jnp.sum(sizes), slot_start[e_of_row] + rank - row_start[e_of_row], n_tiles * m)
    slot_token = jnp.full((n_tiles * m,), M, jnp.int32).at[slot].set(token, mode="drop")  # M: padding
    slot_weight = jnp.zeros((n_tiles * m,), x.dtype).at[slot].set(w, mode="drop")
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(n_tiles, dtype=jnp.int32), side="right")
    dt = x.dtype

    def one_tile(t, out):
        tok = jax.lax.dynamic_slice_in_dim(slot_token, t * m, m)
        wt = jax.lax.dynamic_slice_in_dim(slot_weight, t * m, m)
        xt = x.at[tok].get(mode="fill", fill_value=0)  # [m, D]; padding rows are zeros
        e = tile_expert[t]
        g = xt @ p["gate"][e].astype(dt)
        u = xt @ p["up"][e].astype(dt)
        if "gate_bias" in p:
            g = g + p["gate_bias"][e].astype(dt)
            u = u + p["up_bias"][e].astype(dt)
        y = _activation(g, u, c) @ p["down"][e].astype(dt)
        if "down_bias" in p:
            y = y + p["down_bias"][e].astype(dt)
        return out.at[tok].add((y * wt[:, None]).astype(jnp.float32), mode="drop")

    out = jax.lax.fori_loop(0, used, one_tile, jnp.zeros((M, D), jnp.float32))
    return out.astype(dt)


_EXPERT_NAMES = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


def _axes_dividing(mesh, names, n: int) -> tuple[str, ...]:
    """The mesh axes of ``names`` with size > 1, if their product divides n, else () (the rule
    ``sharding.spec_fits`` applies to a dimension)."""
    axes = tuple(a for a in names if mesh.shape.get(a, 1) > 1)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return axes if axes and n % size == 0 else ()


def routed_experts(x, weights, idx, p, c):
    """x [B, T, D], weights / idx [B, T, k] -> [B, T, D]: every routed pair, expert-parallel on
    the current mesh (see the module docstring)."""
    B, T, D = x.shape
    experts = {n: p[n] for n in _EXPERT_NAMES if n in p}
    mesh = _current_mesh()
    expert_axes = () if mesh is None else _axes_dividing(mesh, EXPERT_MESH_AXES, c.num_experts)
    if not expert_axes:
        flat = lambda a: a.reshape(B * T, a.shape[-1])
        return grouped_experts(flat(x), flat(weights), flat(idx), experts, c).reshape(B, T, D)

    from jax.sharding import PartitionSpec as P

    batch_axes = _axes_dividing(mesh, BATCH_MESH_AXES, B)
    gather = tuple(a for a in expert_axes if a in batch_axes)  # tokens differ along these
    reduce = tuple(a for a in expert_axes if a not in batch_axes)  # tokens identical along these
    n_local = c.num_experts
    for a in expert_axes:
        n_local //= mesh.shape[a]

    def local(x, weights, idx, experts):
        if gather:
            x, weights, idx = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, weights, idx))
        b = x.shape[0]
        first = jax.lax.axis_index(expert_axes) * n_local
        flat = lambda a: a.reshape(b * T, a.shape[-1])
        y = grouped_experts(flat(x), flat(weights), flat(idx), experts, c, first).reshape(b, T, D)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        if reduce:
            y = jax.lax.psum(y, reduce)
        return y

    tokens = P(batch_axes or None, None, None)
    expert_spec = {n: P(expert_axes) for n in experts}
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, expert_spec),
        out_specs=tokens,
        check_vma=False,
    )(x, weights, idx, experts)


def moe_block(y: jax.Array, p: dict, c) -> tuple[jax.Array, jax.Array]:
    """One MoE MLP: y [B, T, D] (post-attention normed) -> (output [B, T, D], load [E] int32)."""
    weights, idx = route(y, p, c)
    out = routed_experts(y, weights, idx, p, c)
    if "shared_gate" in p:  # qwen3_5_moe: sigmoid-gated shared expert on every token
        shared = swiglu_mlp(y, p["shared_gate"], p["shared_up"], p["shared_down"])
        gate = jnp.einsum("BTD,DO->BTO", y, p["shared_expert_gate"].astype(y.dtype))
        out = out + jax.nn.sigmoid(gate) * shared
    return out, expert_load(idx, c.num_experts)
