"""The benchmarks' FLOP formulas (dflash_jax.tools.flops) against a hand count on a tiny config."""

from __future__ import annotations

import pytest

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.target.config import TargetConfig
from dflash_jax.tools import flops

# D=64, 4 query heads and 2 kv heads of 16, MLP 128, 4 layers, V=512.
TARGET = TargetConfig(
    model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip
DRAFTER = DrafterConfig.for_target(
    TARGET, num_layers=1, mask_token_id=511, block_size=4, target_layer_ids=(1, 3)
)


def test_layer_weights_count_k_and_v_once_with_their_kv_heads():
    # q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down 3 x 64x128
    assert flops.layer_weights(TARGET) == 4096 + 2048 + 2048 + 4096 + 24576 == 36864


def test_target_forward_by_hand():
    assert flops.target_forward_flops(TARGET, tokens=10) == 2 * 4 * 36864 * 10 == 2_949_120
    assert flops.lm_head_flops(TARGET, positions=3) == 2 * 64 * 512 * 3


def test_drafter_forward_and_train_step_by_hand():
    assert DRAFTER.feature_size == 128  # two taps of 64
    ctx, blocks = 10, 2  # 10 context tokens, 2 blocks of B=4: 8 block tokens, 6 trained slots
    per_layer = (4096 + 4096 + 24576) * 8 + (2048 + 2048) * (10 + 8)  # q,o,MLP on blocks; k,v on ctx+blocks
    fc, head = 128 * 64 * 10, 2 * 64 * 512 * 6
    assert per_layer == 335_872
    assert (
        flops.drafter_forward_flops(TARGET, DRAFTER, ctx, blocks) == 2 * (fc + per_layer) + head == 1_228_800
    )
    # trained layers x3, fc x2 (its input needs no gradient), frozen lm_head x2 (input gradient only)
    train = 3 * 2 * per_layer + 2 * 2 * fc + 2 * head
    assert flops.drafter_train_flops(TARGET, DRAFTER, ctx, blocks) == train == 3_129_344
    step = flops.train_step_flops(TARGET, DRAFTER, context_tokens=ctx, blocks=blocks, label_positions=10)
    assert step == 2_949_120 + 2 * 64 * 512 * 10 + train
    cached = flops.train_step_flops(
        TARGET, DRAFTER, context_tokens=ctx, blocks=blocks, label_positions=0, target_forward=False
    )
    assert cached == train


def test_a_draft_vocabulary_shrinks_only_the_drafter_head():
    small = DRAFTER.replace(draft_vocab_size=128)
    full = flops.drafter_forward_flops(TARGET, DRAFTER, 10, 2)
    assert full - flops.drafter_forward_flops(TARGET, small, 10, 2) == pytest.approx(2 * 64 * (512 - 128) * 6)


def test_label_positions_are_every_token_for_ce_and_the_predicted_slots_for_kl():
    # ce labels the argmax at each context token; kl the distribution at the B-1 slots after each anchor
    assert flops.label_positions("ce", context_tokens=768, blocks=256, block_size=4) == 768
    assert flops.label_positions("kl", context_tokens=768, blocks=256, block_size=4) == 256 * 3
