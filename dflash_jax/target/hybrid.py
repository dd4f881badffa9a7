"""The Qwen3.5 / Qwen3.6 hybrid target in Flax NNX: Gated DeltaNet layers and gated full attention.

Same API as ``TargetModel`` (embed / logits / init_cache / __call__ with layer_ids, segment_ids and
a cache), so the trainer, generation and speculative decoding use it unchanged. Per layer
(``config.layer_types``):

* ``linear_attention``: Gated DeltaNet (``gated_deltanet.py``): in_proj_qkv -> causal depthwise conv
  + SiLU -> L2-normalised q, k; beta = sigmoid(in_proj_b); log decay g = -exp(A_log) *
  softplus(in_proj_a + dt_bias); the gated delta rule (chunked); a gated RMSNorm (weight * norm(o) *
  SiLU(in_proj_z)) per value head; out_proj.
* ``full_attention``: q_proj yields per head [query ; output gate]; (1 + w) RMSNorm on q and k;
  RoPE on the first ``rotary_dim`` dims only (partial rotary); attention (the dense target's
  ``attention.attend``); output * sigmoid(gate); o_proj.

Every RMSNorm outside the DeltaNet scales by ``(1 + w)`` (HF stores w, zero-initialised). Text
positions are one stream, so Qwen3.5's multimodal RoPE sections (mrope) all rotate alike and
reduce to plain RoPE.

Layers are scanned in periods: the shortest repeating pattern of ``layer_types`` (Qwen3.6-27B:
3 linear + 1 full, 16 times) is one ``lax.scan`` step with its layers unrolled, so compile time does
not grow with depth and no layer pays for a ``cond``. Parameters are stacked per kind:
``layers.*`` [L, ...] (norms, MLP), ``attn.*`` [La, ...], ``gdn.*`` [Lg, ...] in layer order.

Cache (``HybridCache``): K/V of the full-attention layers as in ``KVCache``, plus per row the conv
window (the last W-1 conv inputs) and the recurrent state of every DeltaNet layer. A forward with a
cache also keeps what it needs to roll back (the state and window before it, and its own conv inputs,
decays and betas), so ``with_lengths`` can crop each row to any length reached inside that forward
(recomputing the state over the kept tokens only) exactly as cropping a KV cache: speculative
verification stays lossless.

Dimension names: as in model.py, plus C conv channels (q|k|v), W conv taps, Hk / Hv linear key /
value heads, Dk / Dv their head dims, G scan periods.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.layers import apply_rope, param, rope_cos_sin, swiglu_mlp
from dflash_jax.sharding import constrain
from dflash_jax.target.attention import attend
from dflash_jax.target.config import FULL_ATTENTION, TargetConfig
from dflash_jax.target.gated_deltanet import (
    causal_conv,
    chunk_gated_delta_rule,
    conv_window_at,
    l2_normalize,
)
from dflash_jax.target.model import (
    StackedParams,
    TargetModel,
    TargetOutput,
    cached_kv,
    dense_mlp_specs,
    layer_period,
    per_period,
    write_cache_rows,
)
from dflash_jax.target.moe import moe_block, moe_param_specs

DEFAULT_CHUNK = 64


# ---- norms --------------------------------------------------------------------------------


def rms_norm_1p(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5's zero-centred RMSNorm: norm(x) * (1 + w), all in fp32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """w * norm(x) (in x's dtype) * SiLU(gate) (in fp32), cast back: the DeltaNet output norm."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
    y = weight.astype(dtype) * normed
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the first cos.shape[-1] dims of each head, the rest passed through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)


# ---- parameters -----------------------------------------------------------------------------


def conv_channels(c: TargetConfig) -> int:
    return (
        2 * c.linear_num_key_heads * c.linear_key_head_dim
        + c.linear_num_value_heads * c.linear_value_head_dim
    )


def split_qkv(qkv: jax.Array, c: TargetConfig):
    """[B,T,C] conv outputs in our grouped order -> q, k [B,T,Hk,Dk], v [B,T,Hv,Dv]."""
    B, T, _ = qkv.shape
    Hk, Dk = c.linear_num_key_heads, c.linear_key_head_dim
    g = qkv.reshape(B, T, Hk, -1)
    v = g[..., 2 * Dk :].reshape(B, T, c.linear_num_value_heads, c.linear_value_head_dim)
    return g[..., :Dk], g[..., Dk : 2 * Dk], v


def hybrid_param_specs(c: TargetConfig) -> dict[str, dict[str, tuple[tuple[int, ...], tuple, str]]]:
    """group -> name -> (per-layer shape, logical axes, init). Groups: layers (every layer),
    attn (full-attention layers), gdn (linear-attention layers), moe (qwen3_5_moe: every layer)."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    Hv, Dv = c.linear_num_value_heads, c.linear_value_head_dim
    # The fused q|k|v conv channels are stored grouped by key head (qkv_channel_order), so they
    # split over ``tensor`` along the heads like z, beta, decay and out_proj.
    layers = {
        "input_norm": ((D,), ("norm",), "zeros"),
        "post_norm": ((D,), ("norm",), "zeros"),
    }
    if not c.is_moe:  # qwen3_5_moe: every layer's MLP is the MoE block (group ``moe``)
        layers.update(dense_mlp_specs(c))
    return {
        "layers": layers,
        "attn": {
            "q": ((D, N, 2 * H), ("embed", "heads", "head_dim"), "normal"),  # per head [query ; gate]
            "k": ((D, K, H), ("embed", "kv_heads", "head_dim"), "normal"),
            "v": ((D, K, H), ("embed", "kv_heads", "head_dim"), "normal"),
            "o": ((N, H, D), ("heads", "head_dim", "embed"), "normal"),
            "q_norm": ((H,), ("head_dim",), "zeros"),
            "k_norm": ((H,), ("head_dim",), "zeros"),
        },
        "gdn": {
            "in_qkv": ((D, conv_channels(c)), ("embed", "heads"), "normal"),
            "in_z": ((D, Hv, Dv), ("embed", "heads", "head_dim"), "normal"),
            "in_b": ((D, Hv), ("embed", "heads"), "normal"),
            "in_a": ((D, Hv), ("embed", "heads"), "normal"),
            "conv": ((conv_channels(c), c.linear_conv_kernel_dim), ("heads", None), "normal"),
            "dt_bias": ((Hv,), ("norm",), "ones"),
            "A_log": ((Hv,), ("norm",), "zeros"),
            "norm": ((Dv,), ("head_dim",), "ones"),
            "out": ((Hv, Dv, D), ("heads", "head_dim", "embed"), "normal"),
        },
        **({"moe": moe_param_specs(c)} if c.is_moe else {}),
    }


# ---- cache ------------------------------------------------------------------------------------


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "k",
        "v",
        "lengths",
        "conv",
        "state",
        "base",
        "conv0",
        "state0",
        "x",
        "g",
        "beta",
        "conv_w",
    ],
    meta_fields=["num_key_heads", "chunk_size"],
)
@dataclass
class HybridCache:
    """Per-row cache of a hybrid target (see the module docstring).

    ``lengths`` are the committed tokens per row. The rollback fields (``base`` .. ``conv_w``) are
    set by a forward and cleared by ``with_lengths`` / ``commit``; None when committed."""

    k: jax.Array  # [La, B, S, K, H]
    v: jax.Array  # [La, B, S, K, H]
    lengths: jax.Array  # [B] int32
    conv: jax.Array  # [Lg, B, W-1, C] conv inputs just before position lengths
    state: jax.Array  # [Lg, B, Hv, Dk, Dv] fp32 recurrent state after lengths tokens
    base: jax.Array | None = None  # [B] lengths before the last forward
    conv0: jax.Array | None = None  # [Lg, B, W-1, C] window before the last forward
    state0: jax.Array | None = None  # [Lg, B, Hv, Dk, Dv] state before the last forward
    x: jax.Array | None = None  # [Lg, B, T, C] the last forward's conv inputs
    g: jax.Array | None = None  # [Lg, B, T, Hv] its log decays
    beta: jax.Array | None = None  # [Lg, B, T, Hv] its betas
    conv_w: jax.Array | None = None  # [Lg, C, W] conv weights (to recompute k, v)
    num_key_heads: int = 0
    chunk_size: int = DEFAULT_CHUNK

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def commit(self) -> HybridCache:
        """Keep every token of the last forward (drop the rollback data)."""
        return HybridCache(
            self.k,
            self.v,
            self.lengths,
            self.conv,
            self.state,
            num_key_heads=self.num_key_heads,
            chunk_size=self.chunk_size,
        )

    def with_lengths(self, lengths) -> HybridCache:
        """Crop each row to ``lengths`` (between its length before the last forward and after it):
        K/V by length as in KVCache; conv window and recurrent state recomputed over the kept
        tokens of the last forward from the state before it."""
        lengths = jnp.asarray(lengths, jnp.int32)
        if self.base is None:
            raise ValueError(
                "HybridCache.with_lengths needs the rollback data of the last forward; "
                "crop right after the forward that wrote the tokens (this cache is already committed)"
            )
        T = self.x.shape[2]
        n = jnp.clip(lengths - self.base, 0, T)  # kept tokens of the last forward, per row
        keep = (jnp.arange(T)[None, :] < n[:, None])[..., None]  # [B,T,1]

        def one_layer(args):
            conv0, state0, x, g, beta, w = args
            window = conv_window_at(conv0, x, n)
            qkv = causal_conv(x, conv0, w)
            B, Hv, Dk, Dv = x.shape[0], state0.shape[1], state0.shape[2], state0.shape[3]
            g_qkv = qkv.reshape(B, T, self.num_key_heads, -1)  # grouped by key head
            k = l2_normalize(g_qkv[..., Dk : 2 * Dk])
            v = g_qkv[..., 2 * Dk :].reshape(B, T, Hv, Dv)
            _, state = chunk_gated_delta_rule(
                k,  # the query only shapes outputs we do not use
                k,
                v,
                jnp.where(keep, g, 0.0),
                jnp.where(keep, beta, 0.0),
                chunk_size=self.chunk_size,
                initial_state=state0,
            )
            return window, state

        conv, state = jax.lax.map(
            one_layer, (self.conv0, self.state0, self.x, self.g, self.beta, self.conv_w)
        )
        return HybridCache(
            self.k,
            self.v,
            lengths,
            conv,
            state,
            num_key_heads=self.num_key_heads,
            chunk_size=self.chunk_size,
        )


# ---- model ------------------------------------------------------------------------------------


class HybridTargetModel(TargetModel):
    """Frozen Qwen3.5-family LLM. Call: ``target(input_ids, positions=None, *, layer_ids=())``."""

    def __init__(
        self,
        config: TargetConfig,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        attention_impl: str = "auto",
    ):
        if not config.is_hybrid:
            raise ValueError(
                f"HybridTargetModel needs a qwen3_5 / qwen3_5_moe config, got {config.model_type!r}"
            )
        rngs = rngs or nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.chunk_size = int(chunk_size)
        self.attention_impl = attention_impl
        c = config
        specs = hybrid_param_specs(c)
        self.embed_tokens = param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), self.dtype)
        self.layers = StackedParams(specs["layers"], c.num_layers, param_dtype=self.dtype, rngs=rngs)
        self.attn = StackedParams(
            specs["attn"], len(c.full_attention_layers), param_dtype=self.dtype, rngs=rngs
        )
        self.gdn = StackedParams(
            specs["gdn"], len(c.linear_attention_layers), param_dtype=self.dtype, rngs=rngs
        )
        if c.is_moe:
            if c.moe_layers != tuple(range(c.num_layers)):
                raise ValueError(f"{c.model_type}: every layer must be a MoE layer, got {c.moe_layers}")
            self.moe = StackedParams(specs["moe"], c.num_layers, param_dtype=self.dtype, rngs=rngs)
        self.norm = param(None, (c.hidden_size,), ("norm",), self.dtype, init="zeros")
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), self.dtype)

    def init_cache(self, batch: int, capacity: int, dtype: Any = None) -> HybridCache:
        c = self.config
        dtype = dtype or self.dtype
        La, Lg = len(c.full_attention_layers), len(c.linear_attention_layers)
        kv = (La, batch, capacity, c.num_kv_heads, c.head_dim)
        return HybridCache(
            k=jnp.zeros(kv, dtype),
            v=jnp.zeros(kv, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
            conv=jnp.zeros((Lg, batch, c.linear_conv_kernel_dim - 1, conv_channels(c)), dtype),
            state=jnp.zeros(
                (Lg, batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                jnp.float32,
            ),
            num_key_heads=c.linear_num_key_heads,
            chunk_size=self.chunk_size,
        )

    # ---- layers ---------------------------------------------------------------------------------

    def _attention(self, p, y, cos, sin, masks, kv, lengths):
        c = self.config
        H = c.head_dim
        qg = jnp.einsum("BTD,DNH->BTNH", y, p["q"])
        q, gate = qg[..., :H], qg[..., H:]
        k = jnp.einsum("BTD,DKH->BTKH", y, p["k"])
        v = jnp.einsum("BTD,DKH->BTKH", y, p["v"])
        q = rms_norm_1p(q, p["q_norm"], c.rms_norm_eps)
        k = rms_norm_1p(k, p["k_norm"], c.rms_norm_eps)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        q = constrain(q, ("batch", "length", "act_heads", None))
        k, v, new_kv = cached_kv(kv, k, v, lengths)
        attn = attend(q, k, v, *masks, H**-0.5, impl=self.attention_impl)
        attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
        return jnp.einsum("BTNH,NHD->BTD", attn, p["o"]), new_kv

    def _deltanet(self, p, y, segment_ids, conv_state):
        """-> (output [B,T,D], (window after, state after, rollback data) | None)."""
        c = self.config
        B, T, _ = y.shape
        x = jnp.einsum("BTD,DC->BTC", y, p["in_qkv"])
        z = jnp.einsum("BTD,DHV->BTHV", y, p["in_z"])
        b = jnp.einsum("BTD,DH->BTH", y, p["in_b"])
        a = jnp.einsum("BTD,DH->BTH", y, p["in_a"])
        if conv_state is None:
            window = jnp.zeros((B, c.linear_conv_kernel_dim - 1, x.shape[-1]), x.dtype)
            state0 = None
        else:
            window, state0 = conv_state
        qkv = causal_conv(x, window, p["conv"], segment_ids)
        q, k, v = split_qkv(qkv, c)
        q, k = l2_normalize(q), l2_normalize(k)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
        )
        o, state = chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=state0, segment_ids=segment_ids
        )
        o = gated_rms_norm(o, z, p["norm"], c.rms_norm_eps)
        out = jnp.einsum("BTHV,HVD->BTD", o, p["out"])
        if conv_state is None:
            return out, None
        new_window = jnp.concatenate([window, x.astype(window.dtype)], axis=1)[:, T:]
        rollback = (window, state0, x.astype(window.dtype), g, beta.astype(jnp.float32), p["conv"])
        return out, (new_window, state, rollback)

    # ---- forward --------------------------------------------------------------------------------

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        *,
        layer_ids: tuple[int, ...] | list[int] = (),
        segment_ids: jax.Array | None = None,
        cache: HybridCache | None = None,
        return_logits: bool = True,
    ) -> TargetOutput:
        """As ``TargetModel.__call__``. With a cache the returned cache holds lengths + T tokens
        per row and can be cropped back (``with_lengths``) or committed (``commit``)."""
        c = self.config
        taps, positions, x, mask = self._begin(input_ids, positions, layer_ids, segment_ids, cache)
        B, T = input_ids.shape
        cos, sin = rope_cos_sin(positions, c.rope, c.rotary_dim)

        # One scan step per period of layer_types, its layers unrolled with static kinds.
        P = layer_period(c.layer_types)
        G = c.num_layers // P
        kinds = c.layer_types[:P]
        n_attn = sum(k == FULL_ATTENTION for k in kinds)
        n_gdn = P - n_attn

        slot_of_layer = taps.slots(c.num_layers).reshape(G, P)
        feats0 = taps.buffer(B, T, c.hidden_size, self.dtype)

        def period(carry, xs):
            h, feats = carry
            layer_params, attn_params, gdn_params, slots, kv, conv_state, moe_params = xs
            new_kv, new_conv, loads = [], [], []
            ia = ig = 0
            for j, kind in enumerate(kinds):
                p = jax.tree.map(lambda a, j=j: a[j], layer_params)
                y = rms_norm_1p(h, p["input_norm"], c.rms_norm_eps)
                if kind == FULL_ATTENTION:
                    pa = jax.tree.map(lambda a, ia=ia: a[ia], attn_params)
                    layer_kv = None if kv is None else (kv[0][ia], kv[1][ia])
                    out, nkv = self._attention(
                        pa, y, cos, sin, mask, layer_kv, None if cache is None else cache.lengths
                    )
                    new_kv.append(nkv)
                    ia += 1
                else:
                    pg = jax.tree.map(lambda a, ig=ig: a[ig], gdn_params)
                    layer_cs = None if conv_state is None else (conv_state[0][ig], conv_state[1][ig])
                    out, ncs = self._deltanet(pg, y, segment_ids, layer_cs)
                    new_conv.append(ncs)
                    ig += 1
                h = h + out
                y = rms_norm_1p(h, p["post_norm"], c.rms_norm_eps)
                if moe_params is not None:
                    out, load = moe_block(y, jax.tree.map(lambda a, j=j: a[j], moe_params), c)
                    loads.append(load)
                    h = h + out
                else:
                    h = h + swiglu_mlp(y, p["gate"], p["up"], p["down"])
                h = constrain(h, ("batch", "length", "act_embed"))
                feats = jax.lax.dynamic_update_index_in_dim(feats, h, slots[j], axis=0)
            stack = lambda items: (
                None if cache is None or not items else jax.tree.map(lambda *a: jnp.stack(a), *items)
            )
            loads = jax.tree.map(lambda *a: jnp.stack(a), *loads) if loads else None
            return (h, feats), (stack(new_kv), stack(new_conv), loads)

        xs = (
            per_period(self.layers.stacked(), G, P),
            per_period(self.attn.stacked(), G, n_attn) if n_attn else None,
            per_period(self.gdn.stacked(), G, n_gdn) if n_gdn else None,
            slot_of_layer,
            None if cache is None or not n_attn else per_period((cache.k, cache.v), G, n_attn),
            None if cache is None or not n_gdn else per_period((cache.conv, cache.state), G, n_gdn),
            per_period(self.moe.stacked(), G, P) if c.is_moe else None,
        )
        (h, feats), (kv_out, conv_out, loads) = jax.lax.scan(period, (x, feats0), xs)

        hidden = rms_norm_1p(h, self.norm[...], c.rms_norm_eps)
        new_cache = None
        if cache is not None:
            flat = lambda a: a.reshape(G * a.shape[1], *a.shape[2:])  # [G, n, ...] -> [G*n, ...]
            if n_attn:
                k_new, v_new = (
                    write_cache_rows(buf, flat(a), cache.lengths)
                    for buf, a in zip((cache.k, cache.v), kv_out, strict=True)
                )
            else:
                k_new, v_new = cache.k, cache.v
            if n_gdn:
                window, state, (conv0, state0, xin, g, beta, conv_w) = jax.tree.map(flat, conv_out)
            else:
                window, state, conv0, state0 = cache.conv, cache.state, cache.conv, cache.state
                xin = g = beta = conv_w = None
            new_cache = HybridCache(
                k_new,
                v_new,
                cache.lengths + T,
                window,
                state,
                base=cache.lengths,
                conv0=conv0,
                state0=state0,
                x=xin,
                g=g,
                beta=beta,
                conv_w=conv_w,
                num_key_heads=c.linear_num_key_heads,
                chunk_size=self.chunk_size,
            )
        out = self._output(hidden, taps.features(feats), new_cache, return_logits)
        if loads is not None:
            out.expert_load = loads.reshape(-1, c.num_experts)
        return out


def build_target_model(
    config: TargetConfig,
    *,
    dtype: Any = jnp.float32,
    rngs: nnx.Rngs | None = None,
    attention_impl: str = "auto",
):
    """The model class for ``config``: HybridTargetModel for qwen3_5 / qwen3_5_moe, TargetModel
    otherwise."""
    if config.is_hybrid:
        return HybridTargetModel(config, dtype=dtype, rngs=rngs, attention_impl=attention_impl)
    return TargetModel(config, dtype=dtype, rngs=rngs, attention_impl=attention_impl)


__all__ = ["HybridCache", "HybridTargetModel", "build_target_model", "hybrid_param_specs"]
