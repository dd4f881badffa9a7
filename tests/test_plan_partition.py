"""The loss, the labels and the vocabulary head are split like the batch on 8 simulated devices:
the compiled train step's matmul FLOPs per device are total / 8 on every layout, and no
collective of the step moves vocabulary-sized arrays (partial logits summed over fsdp)."""

from __future__ import annotations

import jax
import pytest

from dflash_jax.tools import hlo_stats, plan
from dflash_jax.training.run_config import load_run_config

# A vocabulary no other dimension shares, large enough that the head is most of the step's FLOPs
# (so a head recomputed on every data replica is far outside the 10% below).
VOCAB, HIDDEN = 1536, 128
OVERRIDES = [
    f"target.architecture={{model_type: qwen3, vocab_size: {VOCAB}, hidden_size: 128,"
    " intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 8,"
    " num_key_value_heads: 4, head_dim: 32}",
    "drafter.num_layers=1",
    "drafter.mask_token_id=1000",
    "drafter.target_layer_ids=null",
    "target.dtype=float32",
    "data.max_length=64",
    "data.batch_size=8",
    "train.max_anchors=8",
    "train.loss_chunk=32",
]


@pytest.fixture(scope="module")
def spec():
    return plan.spec_for_run(load_run_config("qwen3-8b", OVERRIDES))


@pytest.fixture(scope="module")
def one_device_flops(spec):
    return plan.plan_layout(spec, plan.parse_layout("data=1"), jax.devices()[:1]).flops


@pytest.mark.parametrize("layout", ["data=8", "fsdp=8", "data=4,tensor=2"])
def test_step_flops_split_evenly_and_no_vocabulary_sized_collective(spec, one_device_flops, layout):
    p = plan.plan_layout(spec, plan.parse_layout(layout))
    # Before the loss was partitioned: 3.0x total / 8 on data=8, 1.9x on data=4,tensor=2.
    assert p.flops == pytest.approx(one_device_flops / 8, rel=0.10)
    vocab_sized = [
        (kind, array)
        for kind, array in p.collective_shapes
        if {VOCAB, VOCAB // 2} & set(hlo_stats._dims(array))
        and not (kind == "all-gather" and HIDDEN in hlo_stats._dims(array))
    ]
    # The frozen head is gathered over fsdp once per step (an all-gather of [D, V] or its vocab
    # slice); nothing vocabulary-sized is reduced, scattered or permuted per loss chunk.
    assert vocab_sized == []
    assert p.collective_shapes  # the step does communicate: the listing is not empty by accident
