"""Model FLOPs of the target and the drafter: the one place the benchmarks count them (MFU, GFLOP/s).

Matmul FLOPs of the projections only (2 per multiply-add); attention scores, norms and
elementwise work are not counted. Attention projections carry their grouped-query sizes: q and
o are ``hidden x num_heads * head_dim``, k and v (each counted once) ``hidden x num_kv_heads *
head_dim``. Every target layer is counted as a dense attention + MLP layer (Gated DeltaNet and
MoE layers are not modelled apart).

Training multiplies a forward by 3 where the weights train (forward, input gradient, weight
gradient), by 2 for the drafter's fc (its input, the target's features, needs no gradient) and
for the frozen lm_head (input gradient only).
"""

from __future__ import annotations


def attention_mlp_weights(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, mlp: int) -> dict:
    """Weights (multiply-adds per token) of one layer's projections, by name."""
    return {
        "q": hidden * num_heads * head_dim,
        "k": hidden * num_kv_heads * head_dim,
        "v": hidden * num_kv_heads * head_dim,
        "o": num_heads * head_dim * hidden,
        "mlp": 3 * hidden * mlp,  # gate, up, down
    }


def layer_weights(cfg) -> int:
    """Projection weights of one layer of ``cfg`` (a TargetConfig or DrafterConfig)."""
    w = attention_mlp_weights(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    )
    return sum(w.values())


def target_forward_flops(cfg, tokens: int) -> float:
    """The target's layers over ``tokens`` (feature taps, no logits)."""
    return 2.0 * cfg.num_layers * layer_weights(cfg) * tokens


def lm_head_flops(cfg, positions: int, vocab: int | None = None) -> float:
    """Logits at ``positions`` over ``vocab`` rows (default: the whole vocabulary)."""
    return 2.0 * cfg.hidden_size * (vocab or cfg.vocab_size) * positions


def drafter_forward_flops(target_cfg, drafter_cfg, context_tokens: int, blocks: int) -> float:
    """The drafter over ``context_tokens`` of features and ``blocks`` blocks of B slots: fc over the
    context; per layer q, o and the MLP over the block tokens, k and v over context + block tokens;
    the lm_head over the B-1 trained slots of each block (the draft vocabulary's rows when set)."""
    d = drafter_cfg
    w = attention_mlp_weights(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size)
    block_tokens = blocks * d.block_size
    per_layer = (w["q"] + w["o"] + w["mlp"]) * block_tokens + (w["k"] + w["v"]) * (
        context_tokens + block_tokens
    )
    fc = d.feature_size * d.hidden_size * context_tokens
    head = lm_head_flops(target_cfg, blocks * (d.block_size - 1), getattr(d, "draft_vocab_size", None))
    return 2.0 * (fc + d.num_layers * per_layer) + head


def drafter_train_flops(target_cfg, drafter_cfg, context_tokens: int, blocks: int) -> float:
    """Forward + backward of the drafter (see the module docstring for the multipliers)."""
    d = drafter_cfg
    head = lm_head_flops(target_cfg, blocks * (d.block_size - 1), getattr(d, "draft_vocab_size", None))
    fc = 2.0 * d.feature_size * d.hidden_size * context_tokens
    layers = drafter_forward_flops(target_cfg, drafter_cfg, context_tokens, blocks) - head - fc
    return 3 * layers + 2 * fc + 2 * head


def label_positions(loss: str, context_tokens: float, blocks: float, block_size: int) -> float:
    """Where a step evaluates the target's lm_head for its labels: every context position for
    ``ce`` (the argmax at each token), the block slots after each anchor for ``kl`` (the target's
    distribution at the positions the drafter predicts)."""
    return context_tokens if loss == "ce" else blocks * (block_size - 1)


def train_step_flops(
    target_cfg,
    drafter_cfg,
    *,
    context_tokens: int,
    blocks: int,
    label_positions: int,
    target_forward: bool = True,
) -> float:
    """One training step: the frozen target's forward over the context (``target_forward``; False
    for a step from the feature cache), its lm_head at ``label_positions`` (the labels), and the
    drafter's forward + backward."""
    target = target_forward_flops(target_cfg, context_tokens) if target_forward else 0.0
    labels = lm_head_flops(target_cfg, label_positions)
    return target + labels + drafter_train_flops(target_cfg, drafter_cfg, context_tokens, blocks)
