"""The DFlash drafter (Flax NNX): ``ctx = hidden_norm(fc(features))``, Qwen3-style decoder layers
whose keys/values come from ``[ctx ; block]``, a final norm. Logits go through the target's
lm_head and the noise block is embedded by the target's embed_tokens: neither is a drafter
parameter (invariant 7), so every entry point takes the target (or ready-made embeddings).

Two call modes share the layers:

* ``forward_train``: packed rows ``[B, T]`` with ``A`` anchors per row, all blocks at once.
* ``forward_infer``: one block per row after a context K/V cache (``DrafterCache``), which grows
  by the newly accepted context and never keeps block entries (z-lab's crop-after-draft).

Dtypes: parameters stay in ``param_dtype`` (fp32 in training) and are cast where they are used;
the residual stream, q/k/v and MLP activations are ``compute_dtype`` (bfloat16 by default on GPUs
in training); RMSNorm and RoPE compute in fp32 and return the activations' dtype, the attention
merges its parts by fp32 log-sum-exps, and ``logits`` are fp32.

Named dimensions: B batch, T context length, A anchors, S slots per block (block size),
D hidden, F = K*D features, N/K query/kv heads, H head_dim, L layers, C cache capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dflash_jax.drafter.attention import anchored_attention
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.masks import AnchoredMask
from dflash_jax.layers import RMSNorm, apply_rope, param, project, rope_cos_sin, swiglu_mlp
from dflash_jax.sharding import constrain

# ------------------------------------------------------------------------------------------
# Inference cache
# ------------------------------------------------------------------------------------------


@struct.dataclass
class DrafterCache:
    """Context K/V of every drafter layer, preallocated (jit-friendly), with per-row lengths.

    k, v       [L, B, C, K, H]  k-normed and roped keys, values (compute dtype)
    positions  [B, C] int32     RoPE position of each entry (sliding windows mask by position)
    lengths    [B] int32        entries [0, lengths[b]) of row b are the context; the rest is junk
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_cache(config: DrafterConfig, batch: int, capacity: int, dtype=None) -> DrafterCache:
    """An empty cache for ``batch`` rows of up to ``capacity`` context entries each."""
    dtype = jnp.dtype(dtype or config.compute_dtype)
    shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
    return DrafterCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        positions=jnp.zeros((batch, capacity), jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def crop(cache: DrafterCache, lengths) -> DrafterCache:
    """Keep at most ``lengths`` (int or [B]) context entries per row, like HF ``cache.crop``.

    Entries past the new length are simply ignored and overwritten by later calls.
    """
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), cache.lengths.shape)
    return cache.replace(lengths=jnp.minimum(cache.lengths, lengths))


# ------------------------------------------------------------------------------------------
# Blocks
# ------------------------------------------------------------------------------------------


def block_token_ids(
    input_ids: jax.Array, anchors: jax.Array, block_size: int, mask_token_id: int
) -> jax.Array:
    """[B, T] ids, [B, A] anchors -> [B, A, S] block ids: slot 0 the token at the anchor, the rest
    ``mask_token_id`` (invariant 5)."""
    T = input_ids.shape[1]
    first = jnp.take_along_axis(input_ids, jnp.clip(anchors, 0, T - 1), axis=1)
    ids = jnp.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype)
    return ids.at[..., 0].set(first)


# ------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------


class DrafterAttention(nnx.Module):
    """Block queries over ``[ctx ; block]`` keys; per-head q/k RMSNorm before RoPE (Qwen3)."""

    def __init__(self, config: DrafterConfig, layer: int, *, rngs: nnx.Rngs):
        D, N, K, H = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        pdt = jnp.dtype(config.param_dtype)
        self.q_proj = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), pdt)
        self.k_proj = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pdt)
        self.v_proj = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pdt)
        self.o_proj = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), pdt)
        self.q_norm = RMSNorm(H, config.rms_norm_eps, dtype=pdt)
        self.k_norm = RMSNorm(H, config.rms_norm_eps, dtype=pdt)
        self.causal = config.layer_causal(layer)
        self.window = config.layer_window(layer)
        self.impl = config.attention_impl
        self.anchor_chunk = config.anchor_chunk
        self.matmul_dtype = config.matmul_dtype

    def context_kv(self, ctx: jax.Array, cos: jax.Array, sin: jax.Array):
        """ctx [B, T, D] -> k, v [B, T, K, H] (k normed and roped at the context positions)."""
        k = project("BTD,DKH->BTKH", ctx, self.k_proj[...], self.matmul_dtype)
        v = project("BTD,DKH->BTKH", ctx, self.v_proj[...], self.matmul_dtype)
        return apply_rope(self.k_norm(k), cos, sin), v

    def __call__(self, x, k_ctx, v_ctx, slot_cos, slot_sin, mask: AnchoredMask):
        """x [B, A, S, D] (normed block states) -> [B, A, S, D]."""
        q = project("BASD,DNH->BASNH", x, self.q_proj[...], self.matmul_dtype)
        k = project("BASD,DKH->BASKH", x, self.k_proj[...], self.matmul_dtype)
        v = project("BASD,DKH->BASKH", x, self.v_proj[...], self.matmul_dtype)
        q = apply_rope(self.q_norm(q), slot_cos, slot_sin)
        k = apply_rope(self.k_norm(k), slot_cos, slot_sin)
        o = anchored_attention(
            q,
            k_ctx,
            v_ctx,
            k,
            v,
            mask,
            causal=self.causal,
            window=self.window,
            impl=self.impl,
            anchor_chunk=self.anchor_chunk,
        )
        return project("BASNH,NHD->BASD", o.astype(x.dtype), self.o_proj[...], self.matmul_dtype)


class DrafterMLP(nnx.Module):
    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.intermediate_size
        pdt = jnp.dtype(config.param_dtype)
        self.gate_proj = param(rngs, (D, F), ("embed", "mlp"), pdt)
        self.up_proj = param(rngs, (D, F), ("embed", "mlp"), pdt)
        self.down_proj = param(rngs, (F, D), ("mlp", "embed"), pdt)
        self.matmul_dtype = config.matmul_dtype

    def __call__(self, x):
        lead = x.shape[:-1]
        y = swiglu_mlp(
            x.reshape(lead[0], -1, x.shape[-1]),
            self.gate_proj[...],
            self.up_proj[...],
            self.down_proj[...],
            matmul_dtype=self.matmul_dtype,
        )
        return y.reshape(*lead, -1)


class DrafterLayer(nnx.Module):
    """Pre-norm decoder layer. The context enters only as K/V (it is not normed by input_layernorm)."""

    def __init__(self, config: DrafterConfig, layer: int, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(config.param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=pdt)
        self.self_attn = DrafterAttention(config, layer, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=pdt)
        self.mlp = DrafterMLP(config, rngs=rngs)

    def __call__(self, x, k_ctx, v_ctx, slot_cos, slot_sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), k_ctx, v_ctx, slot_cos, slot_sin, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return constrain(x, ("batch", None, None, "act_embed"))


# ------------------------------------------------------------------------------------------
# The drafter
# ------------------------------------------------------------------------------------------


class DraftVocab(nnx.Variable):
    """The target ids of a reduced draft vocabulary, int32 [N], ascending (invariant 9).

    Data, not a parameter: never trained (the optimizer and gradients see ``nnx.Param`` only),
    but saved and loaded with the parameters (``WEIGHTS``)."""


# What a drafter's checkpoint and exports hold: its parameters and, if it has one, its draft vocabulary.
WEIGHTS = nnx.Any(nnx.Param, DraftVocab)


class DFlashDrafter(nnx.Module):
    """DFlash block-diffusion drafter. Parameters: fc, hidden_norm, layers, norm (no embed/lm_head)."""

    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(config.param_dtype)
        self.config = config
        self.fc = param(rngs, (config.feature_size, config.hidden_size), ("features", "embed"), pdt)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=pdt)
        self.layers = nnx.List([DrafterLayer(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=pdt)
        # A placeholder set (the first N ids) until training/draft_vocab.py chooses the real one.
        self.draft_vocab = (
            None
            if config.draft_vocab_size is None
            else DraftVocab(jnp.arange(config.draft_vocab_size, dtype=jnp.int32), logical_axes=(None,))
        )

    @property
    def compute_dtype(self):
        return jnp.dtype(self.config.compute_dtype)

    # -- shared pieces ----------------------------------------------------------------------

    def project_context(self, features: jax.Array) -> jax.Array:
        """features [B, T, K*D] (raw outputs of all K target taps, in order) -> ctx [B, T, D]."""
        cfg = self.config
        if features.shape[-1] != cfg.feature_size:
            raise ValueError(
                f"features last dim is {features.shape[-1]}, but fc needs all "
                f"{cfg.num_target_features} target layers {list(cfg.target_layer_ids)} x hidden "
                f"{cfg.hidden_size} = {cfg.feature_size}"
            )
        x = features.astype(self.compute_dtype)
        ctx = project("BTF,FD->BTD", x, self.fc[...], cfg.matmul_dtype)
        return constrain(self.hidden_norm(ctx), ("batch", "length", "act_embed"))

    def _rope(self, positions):
        return rope_cos_sin(positions, self.config.rope, self.config.head_dim)

    def embed_blocks(self, target, block_ids: jax.Array) -> jax.Array:
        """Block ids [...] -> noise embeddings [..., D] through the target's embed_tokens."""
        return (target.embed(block_ids) * self.config.embedding_scale).astype(self.compute_dtype)

    def train_block_embeds(self, target, input_ids: jax.Array, anchors: jax.Array) -> jax.Array:
        """[B, T] ids and [B, A] anchors -> block embeddings [B, A, S, D] for forward_train."""
        cfg = self.config
        return self.embed_blocks(
            target, block_token_ids(input_ids, anchors, cfg.block_size, cfg.mask_token_id)
        )

    def head_weight(self, target) -> jax.Array:
        """[D, N]: the rows of the target's frozen lm_head the drafter scores (all V, or the draft
        vocabulary's N). Taken once per step or decoding call, outside any loop over chunks."""
        w = jax.lax.stop_gradient(target.lm_head_weight())
        if self.draft_vocab is None:
            return w
        return jnp.take(w, self.draft_vocab[...], axis=1)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Indices into the drafter's logits -> target token ids (identity without a draft vocabulary)."""
        if self.draft_vocab is None:
            return draft_ids
        return jnp.take(self.draft_vocab[...], draft_ids, axis=0)

    def logits(self, hidden: jax.Array, target, *, compute_dtype=None, head=None) -> jax.Array:
        """Drafter hidden [..., D] -> fp32 logits [..., N] through the target's lm_head rows of
        ``head_weight`` (N = V without a draft vocabulary; + z-lab's output multiplier / soft-cap
        when configured). Decoding and the training loss both call this. ``compute_dtype``: the
        matmul's input dtype (default: hidden's); ``head``: ``head_weight(target)`` if at hand."""
        matmul_dtype = hidden.dtype if compute_dtype is None else compute_dtype
        w = self.head_weight(target) if head is None else head
        out = project("...D,DN->...N", hidden.astype(jnp.float32), w, matmul_dtype)
        if self.config.logit_scale != 1.0:
            out = out * self.config.logit_scale
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            out = jnp.tanh(out / cap) * cap
        return out

    # -- training ---------------------------------------------------------------------------

    def forward_train(
        self,
        features: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        anchors: jax.Array,
        anchor_valid: jax.Array,
        block_embeds: jax.Array,
    ) -> jax.Array:
        """All blocks of packed rows at once.

        features      [B, T, K*D]  raw outputs of the target taps (concatenated in id order)
        positions     [B, T] int   RoPE positions (restart per document)
        segment_ids   [B, T] int   document ids, 0 = padding
        anchors       [B, A] int32 indices into T (sorted ascending per row: lets kernels skip work)
        anchor_valid  [B, A] bool  False: a padding anchor (sees no context, output finite, ignored)
        block_embeds  [B, A, S, D] noise block embeddings (``train_block_embeds``)
        returns       [B, A, S, D] final-normed hidden states (``logits`` turns them into logits)

        Block j sees context entries p < anchors[j] of its own document and its own S slots
        (invariant 3); context p is roped at positions[p], slot k at positions[anchors[j]] + k
        (invariant 4).
        """
        B, T = positions.shape
        if block_embeds.ndim != 4 or block_embeds.shape[:2] != anchors.shape:
            raise ValueError(
                f"block_embeds {block_embeds.shape} must be [B, A, S, D] with [B, A] = {anchors.shape}"
            )
        for name, x in (("features", features), ("segment_ids", segment_ids)):
            if x.shape[:2] != (B, T):
                raise ValueError(f"{name} shape {x.shape} does not start with positions' [B, T] = {(B, T)}")
        context = self.train_context(features, positions)
        return self.forward_blocks(context, positions, segment_ids, anchors, anchor_valid, block_embeds)

    def train_context(self, features: jax.Array, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """The context half of ``forward_train``: every layer's (k_ctx, v_ctx) [B, T, K, H] of the
        rows, which all their blocks share (a step over anchor chunks computes them once)."""
        ctx = self.project_context(features)
        ctx_cos, ctx_sin = self._rope(positions)
        return [layer.self_attn.context_kv(ctx, ctx_cos, ctx_sin) for layer in self.layers]

    def forward_blocks(self, context, positions, segment_ids, anchors, anchor_valid, block_embeds):
        """The block half of ``forward_train`` over ``train_context``'s K/V: blocks never see each
        other (invariant 3), so any subset of a row's anchors gives those blocks' exact outputs."""
        mask = AnchoredMask.for_packed_rows(
            segment_ids, positions, anchors, anchor_valid, block_embeds.shape[2]
        )
        slot_cos, slot_sin = self._rope(mask.slot_positions)
        x = block_embeds.astype(self.compute_dtype)
        for layer, (k_ctx, v_ctx) in zip(self.layers, context, strict=True):
            x = layer(x, k_ctx, v_ctx, slot_cos, slot_sin, mask)
        return self.norm(x)

    # -- inference --------------------------------------------------------------------------

    def init_cache(self, batch: int, capacity: int, dtype=None) -> DrafterCache:
        return init_cache(self.config, batch, capacity, dtype)

    def forward_infer(
        self,
        new_ctx_features: jax.Array,
        ctx_positions: jax.Array,
        block_embeds: jax.Array,
        block_positions: jax.Array,
        cache: DrafterCache,
        new_ctx_lens: jax.Array | None = None,
    ) -> tuple[jax.Array, DrafterCache]:
        """Append newly accepted context to the cache, then draft one block per row.

        new_ctx_features [B, C, K*D]  features of the context entries not yet in the cache
        ctx_positions    [B, C] int   their positions
        block_embeds     [B, S, D]    embedded block (slot 0: last accepted token, rest: mask)
        block_positions  [B, S] int   slot positions (z-lab: ``lengths + arange(S)``)
        cache            DrafterCache from init_cache / a previous call
        new_ctx_lens     [B] int32 or None: only the first new_ctx_lens[b] of the C entries of row b
                         are real (right padding); None = all C
        returns          (hidden [B, S, D] final-normed, cache with lengths += new_ctx_lens)

        The block K/V is never cached (z-lab crops the cache back to the context after each
        draft). The caller keeps ``lengths + C <= capacity``; entries past capacity are dropped.
        """
        B, C = ctx_positions.shape
        if block_embeds.ndim != 3 or block_embeds.shape[0] != B:
            raise ValueError(f"block_embeds {block_embeds.shape} must be [B, S, D] with B={B}")
        cap = cache.capacity
        n_new = jnp.full((B,), C, jnp.int32) if new_ctx_lens is None else new_ctx_lens.astype(jnp.int32)
        offs = jnp.arange(C, dtype=jnp.int32)[None, :]
        slot = jnp.where(offs < n_new[:, None], cache.lengths[:, None] + offs, cap)  # cap = dropped
        rows = jnp.arange(B)[:, None]
        positions = cache.positions.at[rows, slot].set(ctx_positions.astype(jnp.int32), mode="drop")
        lengths = cache.lengths + n_new
        mask = AnchoredMask.for_cache(positions, lengths, block_positions)

        ctx = self.project_context(new_ctx_features)
        ctx_cos, ctx_sin = self._rope(ctx_positions)
        slot_cos, slot_sin = self._rope(mask.slot_positions)
        x = block_embeds[:, None].astype(self.compute_dtype)
        k_all, v_all = cache.k, cache.v
        for i, layer in enumerate(self.layers):
            k_new, v_new = layer.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
            k_all = k_all.at[i, rows, slot].set(k_new.astype(k_all.dtype), mode="drop")
            v_all = v_all.at[i, rows, slot].set(v_new.astype(v_all.dtype), mode="drop")
            x = layer(x, k_all[i].astype(x.dtype), v_all[i].astype(x.dtype), slot_cos, slot_sin, mask)
        hidden = self.norm(x)[:, 0]
        return hidden, DrafterCache(k=k_all, v=v_all, positions=positions, lengths=lengths)
