"""The frozen target LLM in Flax NNX: one decoder-only transformer for Llama, Qwen2, Qwen3 and
the mixture-of-experts Qwen3-MoE and gpt-oss (MoE blocks in ``target/moe.py``).

Layer weights are stacked on a leading ``layers`` axis and applied with ``lax.scan``, so compile
time does not grow with depth. A MoE model stacks its MoE blocks (``moe.*`` [Lm, ...]) and any
dense MLPs (``mlp.*`` [Ld, ...]) apart from the attention (``layers.*`` [L, ...]), and scans the
shortest repeating pattern of MLP kinds as one step (all-MoE models: one layer per step). gpt-oss's
sliding-window layers differ from its full ones only in a scanned per-layer window. A forward
returns the final logits, the final normed hidden state (what lm_head sees), the raw outputs of any
requested layers (the drafter's features) and, for MoE targets, the router's load per expert.

Dimension names: B batch, T query length, S key length, D model width, N query heads,
K kv heads, G query heads per kv head, H head_dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.layers import apply_rope, param, project, rms_norm, rope_cos_sin, swiglu_mlp
from dflash_jax.sharding import constrain
from dflash_jax.target.attention import attend, cache_attention_mask, self_attention_mask
from dflash_jax.target.config import DENSE_MLP, MOE_MLP, TargetConfig
from dflash_jax.target.moe import moe_block, moe_param_specs

_NEG_INF = -1e30


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Preallocated per-layer K/V with per-row lengths.

    New tokens are written at ``lengths[b] + t``; cropping a row after a rejected speculation is
    just lowering its length (stale entries beyond it are masked and later overwritten).
    """

    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    lengths: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def with_lengths(self, lengths) -> KVCache:
        return KVCache(self.k, self.v, jnp.asarray(lengths, jnp.int32))

    def commit(self) -> KVCache:
        """Keep every token written so far (a no-op here; a hybrid cache drops its rollback data)."""
        return self


@jax.tree_util.register_dataclass
@dataclass
class TargetOutput:
    logits: jax.Array | None  # [B, T, V]
    hidden: jax.Array  # [B, T, D] after the final norm
    features: jax.Array  # [B, T, len(layer_ids) * D] raw layer outputs, in layer_ids order
    cache: KVCache | None = None
    # MoE targets: [num MoE layers, E] int32, the (token, choice) pairs routed to each expert in
    # each MoE layer (a metric; padding tokens count too). None for dense targets.
    expert_load: jax.Array | None = None


# Stacked per-layer parameters: name -> (shape builder, logical axes, init)
def _layer_param_specs(c: TargetConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], str]]:
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    specs = {
        "input_norm": ((D,), ("norm",), "ones"),
        "q": ((D, N, H), ("embed", "heads", "head_dim"), "normal"),
        "k": ((D, K, H), ("embed", "kv_heads", "head_dim"), "normal"),
        "v": ((D, K, H), ("embed", "kv_heads", "head_dim"), "normal"),
        "o": ((N, H, D), ("heads", "head_dim", "embed"), "normal"),
        "post_norm": ((D,), ("norm",), "ones"),
    }
    if not c.is_moe:  # a MoE model keeps its dense MLPs (if any) in their own stack
        specs.update(dense_mlp_specs(c))
    if c.attention_sinks:
        specs["sinks"] = ((N,), ("heads",), "zeros")
    if c.attention_bias:
        specs.update(
            q_bias=((N, H), ("heads", "head_dim"), "zeros"),
            k_bias=((K, H), ("kv_heads", "head_dim"), "zeros"),
            v_bias=((K, H), ("kv_heads", "head_dim"), "zeros"),
        )
    if c.o_proj_bias:
        specs["o_bias"] = ((D,), ("norm",), "zeros")
    if c.mlp_bias:
        specs.update(
            gate_bias=((F,), ("mlp",), "zeros"),
            up_bias=((F,), ("mlp",), "zeros"),
            down_bias=((D,), ("norm",), "zeros"),
        )
    if c.qk_norm:
        specs.update(q_norm=((H,), ("head_dim",), "ones"), k_norm=((H,), ("head_dim",), "ones"))
    return specs


def dense_mlp_specs(c: TargetConfig) -> dict:
    D, F = c.hidden_size, c.intermediate_size
    return {
        "gate": ((D, F), ("embed", "mlp"), "normal"),
        "up": ((D, F), ("embed", "mlp"), "normal"),
        "down": ((F, D), ("mlp", "embed"), "normal"),
    }


class StackedParams(nnx.Module):
    """One parameter group of ``count`` layers, each parameter stacked as [count, ...] (scanned
    over): the dense and hybrid targets' layers, attention, DeltaNet and expert groups alike."""

    def __init__(self, specs, count: int, *, param_dtype, rngs: nnx.Rngs):
        self.names = tuple(specs)
        for name, (shape, axes, init) in specs.items():
            setattr(self, name, param(rngs, (count, *shape), ("layers", *axes), param_dtype, init=init))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in self.names}


def layer_period(layer_types: tuple[str, ...]) -> int:
    """The shortest p dividing L with layer_types[i] == layer_types[i % p] (p = L if none shorter)."""
    L = len(layer_types)
    for p in range(1, L + 1):
        if L % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(L)):
            return p
    return L


def per_period(tree, G: int, n: int):
    """[G * n, ...] leaves -> [G, n, ...] (one scan step per period of n such layers)."""
    return jax.tree.map(lambda a: a.reshape(G, n, *a.shape[1:]), tree)


def dense_mlp(y, p):
    return swiglu_mlp(
        y,
        p["gate"],
        p["up"],
        p["down"],
        gate_bias=p.get("gate_bias"),
        up_bias=p.get("up_bias"),
        down_bias=p.get("down_bias"),
    )


def _attend(q, k, v, mask, scale):
    """Dense attention with a [B,T,S] bool mask (O(T x S) memory): kept for callers that already
    hold a dense mask; the target itself uses ``attention.attend`` (tiled, masks as small arrays)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, H)


def cached_kv(kv, k, v, lengths):
    """This forward's k, v [B,T,K,H] placed into one layer's cache buffers ``kv`` = (k_buf, v_buf)
    [B,S,K,H] at each row's length -> (keys, values over the whole buffer, (k, v) in the cache's
    dtype). The cache itself is written once after the layer scan (``write_cache_rows``): a scan
    that returned every layer's whole buffer rewrote the entire cache on each decoding step.
    Without a cache (kv None) the keys and values are this forward's own."""
    if kv is None:
        return k, v, None
    k_new, v_new = k.astype(kv[0].dtype), v.astype(kv[1].dtype)
    # the same writer as the cache's own (positions past the buffer dropped, never shifted back)
    k_all = write_cache_rows(kv[0][None], k_new[None], lengths)[0]
    v_all = write_cache_rows(kv[1][None], v_new[None], lengths)[0]
    return k_all.astype(k.dtype), v_all.astype(v.dtype), (k_new, v_new)


def write_cache_rows(buf, new, lengths):
    """buf [L,B,S,K,H] (every layer's cache), new [L,B,T,K,H]: new[:, b, t] written at
    buf[:, b, lengths[b] + t] (a scatter, in place when buf is not used afterwards)."""
    B, T = new.shape[1], new.shape[2]
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    cols = lengths[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None]
    return buf.at[:, rows, cols].set(new, mode="drop")


@dataclass(frozen=True)
class LayerTaps:
    """Where the raw outputs of the requested layers go during the layer scan.

    The unique tapped layers each own one row of a [U+1, B, T, D] buffer (row U is a discard
    slot for untapped layers), so the scan writes every layer output with one dynamic update."""

    layer_ids: tuple[int, ...]
    unique: tuple[int, ...]

    @classmethod
    def for_layers(cls, layer_ids, num_layers: int) -> LayerTaps:
        layer_ids = tuple(int(i) for i in layer_ids)
        for i in layer_ids:
            if not 0 <= i < num_layers:
                raise ValueError(f"layer_ids: {i} is outside [0, {num_layers}) for this target")
        return cls(layer_ids, tuple(sorted(set(layer_ids))))

    def slots(self, num_layers: int) -> jax.Array:
        """[L] int32: the buffer row of each layer's output."""
        u = self.unique
        return jnp.array([u.index(i) if i in u else len(u) for i in range(num_layers)], jnp.int32)

    def buffer(self, B: int, T: int, D: int, dtype) -> jax.Array:
        return jnp.zeros((len(self.unique) + 1, B, T, D), dtype)

    def features(self, feats: jax.Array) -> jax.Array:
        """[B, T, len(layer_ids) * D]: the tapped outputs concatenated in layer_ids order."""
        if not self.layer_ids:
            _, B, T, _ = feats.shape
            return jnp.zeros((B, T, 0), feats.dtype)
        return jnp.concatenate([feats[self.unique.index(i)] for i in self.layer_ids], axis=-1)


class TargetModel(nnx.Module):
    """Frozen decoder-only LLM. Call: ``target(input_ids, positions=None, *, layer_ids=())``.

    ``attention_impl``: ``auto`` | ``xla`` | ``pallas``, how its attention runs (``attention.attend``;
    ``auto`` is the XLA path unless a GPU check validated the kernel for this device and shape)."""

    def __init__(
        self,
        config: TargetConfig,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs | None = None,
        attention_impl: str = "auto",
    ):
        rngs = rngs or nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.attention_impl = attention_impl
        c = config
        self.embed_tokens = param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), self.dtype)
        self.layers = StackedParams(_layer_param_specs(c), c.num_layers, param_dtype=self.dtype, rngs=rngs)
        if c.is_moe:
            self.moe = StackedParams(moe_param_specs(c), len(c.moe_layers), param_dtype=self.dtype, rngs=rngs)
            if c.dense_mlp_layers:
                self.mlp = StackedParams(
                    dense_mlp_specs(c), len(c.dense_mlp_layers), param_dtype=self.dtype, rngs=rngs
                )
        self.norm = param(None, (c.hidden_size,), ("norm",), self.dtype, init="ones")
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), self.dtype)

    # ---- pieces the drafter and the trainer use directly -------------------------------------

    def embed(self, ids: jax.Array) -> jax.Array:
        """Raw embed_tokens lookup (no scaling): [...] -> [..., D]."""
        return jnp.take(self.embed_tokens[...], ids, axis=0)

    def lm_head_weight(self) -> jax.Array:
        """[D, V]: the untied lm_head, or embed_tokens transposed when tied."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """lm_head only (hidden already final-normed): [..., D] -> fp32 [..., V] (the matmul runs in
        hidden's dtype and accumulates in fp32)."""
        w = self.lm_head_weight()
        return jnp.einsum("...D,DV->...V", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)

    def init_cache(self, batch: int, capacity: int, dtype: Any = None) -> KVCache:
        c = self.config
        shape = (c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim)
        dtype = dtype or self.dtype
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    # ---- forward ----------------------------------------------------------------------------

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        *,
        layer_ids: tuple[int, ...] | list[int] = (),
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        return_logits: bool = True,
    ) -> TargetOutput:
        """Run the target.

        input_ids [B,T]. positions [B,T] (default: 0..T-1, or cache length + t with a cache).
        segment_ids [B,T]: packed documents; a token attends only within its segment (no cache).
        cache: a KVCache; the new tokens are appended at each row's length and attend to the
        cache prefix plus themselves (causally). The returned cache has lengths += T.
        """
        c = self.config
        taps, positions, x, mask = self._begin(input_ids, positions, layer_ids, segment_ids, cache)
        B, T = input_ids.shape
        L = c.num_layers
        cos, sin = rope_cos_sin(positions, c.rope, c.head_dim)
        feats0 = taps.buffer(B, T, c.hidden_size, self.dtype)
        scale = c.head_dim**-0.5
        lengths = None if cache is None else cache.lengths
        windowed = any(c.attention_windows)

        # One scan step per period of MLP kinds, its layers unrolled (dense targets: one layer).
        kinds = c.mlp_kinds if c.is_moe else (DENSE_MLP,) * L
        P = layer_period(kinds)
        G = L // P
        kinds = kinds[:P]
        n_moe = kinds.count(MOE_MLP)
        n_dense = P - n_moe
        # With one layer per period the stacked [L, ...] leaves are scanned as they are: reshaping
        # them to [L, 1, ...] made XLA copy every weight and the whole KV cache on each call, i.e.
        # on every decoding step (BENCHMARKS.md "Decoding and regeneration").
        if P == 1:
            split, member = (lambda tree, n: tree), (lambda a, j: a)
        else:
            split, member = (lambda tree, n: per_period(tree, G, n)), (lambda a, j: a[j])

        def attention(p, h, kv, window):
            y = rms_norm(h, p["input_norm"], c.rms_norm_eps)
            q = project("BTD,DNH->BTNH", y, p["q"])
            k = project("BTD,DKH->BTKH", y, p["k"])
            v = project("BTD,DKH->BTKH", y, p["v"])
            if c.attention_bias:
                q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
            if c.qk_norm:
                q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q = constrain(q, ("batch", "length", "act_heads", None))
            k, v, new_kv = cached_kv(kv, k, v, lengths)
            attn = attend(
                q, k, v, *mask, scale, sinks=p.get("sinks"), window=window if windowed else None,
                impl=self.attention_impl,
            )  # fmt: skip
            out = project("BTNH,NHD->BTD", attn, p["o"])
            if c.o_proj_bias:
                out = out + p["o_bias"]
            return h + out, new_kv

        def period(carry, xs):
            h, feats = carry
            layer_params, moe_params, dense_params, slots, kv, windows = xs
            new_kv, loads = [], []
            im = idn = 0
            for j, kind in enumerate(kinds):
                p = jax.tree.map(lambda a, j=j: member(a, j), layer_params)
                layer_kv = None if kv is None else (member(kv[0], j), member(kv[1], j))
                h, nkv = attention(p, h, layer_kv, member(windows, j))
                new_kv.append(nkv)
                y = rms_norm(h, p["post_norm"], c.rms_norm_eps)
                if kind == MOE_MLP:
                    out, load = moe_block(y, jax.tree.map(lambda a, im=im: member(a, im), moe_params), c)
                    loads.append(load)
                    im += 1
                else:
                    out = dense_mlp(
                        y, p if not c.is_moe else jax.tree.map(lambda a, i=idn: member(a, i), dense_params)
                    )
                    idn += 1
                h = constrain(h + out, ("batch", "length", "act_embed"))
                feats = jax.lax.dynamic_update_index_in_dim(feats, h, member(slots, j), axis=0)
            stack = lambda items: (
                None
                if not items or items[0] is None
                else items[0]
                if P == 1
                else jax.tree.map(lambda *a: jnp.stack(a), *items)
            )
            return (h, feats), (stack(new_kv), stack(loads))

        moe_xs = split(self.moe.stacked(), n_moe) if n_moe else None
        dense_xs = split(self.mlp.stacked(), n_dense) if c.is_moe and n_dense else None
        xs = (
            split(self.layers.stacked(), P),
            moe_xs,
            dense_xs,
            split(taps.slots(L), P),
            None if cache is None else split((cache.k, cache.v), P),
            split(jnp.asarray(c.attention_windows, jnp.int32), P),
        )
        (h, feats), (new_kv, loads) = jax.lax.scan(period, (x, feats0), xs)

        hidden = rms_norm(h, self.norm[...], c.rms_norm_eps)
        new_cache = None
        if cache is not None:
            flat = lambda a: a if P == 1 else a.reshape(L, *a.shape[2:])
            new_cache = KVCache(
                write_cache_rows(cache.k, flat(new_kv[0]), cache.lengths),
                write_cache_rows(cache.v, flat(new_kv[1]), cache.lengths),
                cache.lengths + T,
            )
        out = self._output(hidden, taps.features(feats), new_cache, return_logits)
        if loads is not None:
            out.expert_load = loads.reshape(-1, c.num_experts)
        return out

    # ---- plumbing shared with the hybrid target (target/hybrid.py) ------------------------------

    def _begin(self, input_ids, positions, layer_ids, segment_ids, cache):
        """Checks and the start of every forward -> (LayerTaps, positions [B,T], embedded input
        [B,T,D], attention mask pieces for ``attention.attend``). Positions default to 0..T-1, or
        continue each row's cache length."""
        taps = LayerTaps.for_layers(layer_ids, self.config.num_layers)
        B, T = input_ids.shape
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids cannot be combined with a cache")
        if positions is None:
            base = cache.lengths[:, None] if cache is not None else jnp.zeros((B, 1), jnp.int32)
            positions = base + jnp.arange(T, dtype=jnp.int32)[None]
        x = self.embed(input_ids).astype(self.dtype)
        x = constrain(x, ("batch", "length", "act_embed"))
        if cache is None:
            mask = self_attention_mask(B, T, segment_ids)
        else:
            mask = cache_attention_mask(cache.lengths, T, cache.capacity)
        return taps, positions, x, mask

    def _output(self, hidden, features, cache, return_logits: bool) -> TargetOutput:
        logits = self.logits(hidden) if return_logits else None
        return TargetOutput(logits=logits, hidden=hidden, features=features, cache=cache)
