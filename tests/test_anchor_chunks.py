"""train.anchor_chunks: a row's anchors in sequential chunks give the unchunked step's update."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_micro_batches import _one_step

from dflash_jax.training.run_config import TrainSection

# fp32 throughout; only the order of the loss's and the gradients' sums differs.
RTOL, ATOL = 1e-4, 2e-6


@pytest.mark.parametrize(
    "chunks,extra",
    [
        (3, {}),  # ce, decay weights
        pytest.param(2, {"loss": "kl", "loss_weighting": "dpace", "remat": "full"}, marks=pytest.mark.slow),
        pytest.param(2, {"micro_batches": 2}, marks=pytest.mark.slow),  # chunks inside each micro-batch
    ],
)
def test_chunked_anchors_give_the_unchunked_update(chunks, extra):
    base = {"max_anchors": 6, "loss_chunk": 16, **extra}
    unchunked = {k: v for k, v in base.items() if k != "micro_batches"}
    want_params, want = _one_step(TrainSection(**unchunked))
    got_params, got = _one_step(TrainSection(**base, anchor_chunks=chunks))
    for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(got_params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=ATOL, rtol=RTOL)
    for k in ("loss", "streak", "slot_acc", "anchors", "tokens", "grad_norm", "label_coverage"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert got["loss"] > 0 and got["grad_norm"] > 0


def test_anchor_chunks_must_divide_the_anchors():
    with pytest.raises(
        ValueError, match=r"train.anchor_chunks=4 must be >= 1 and divide train.max_anchors=6"
    ):
        TrainSection(max_anchors=6, anchor_chunks=4)
