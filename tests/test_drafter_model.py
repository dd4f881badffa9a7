"""DFlash drafter model: invariants 1, 3, 4, 5, 7 and training mode == inference mode.

Each invariant test perturbs one input and checks which outputs move; every one of them was seen
failing with the corresponding bug put in on purpose (fc slice dropped, ``p <= anchor``, blocks
sharing keys, no document check, causal in-block mask, slot positions off by one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import StubTarget, stub_target_config
from flax import nnx

from dflash_jax.drafter.api import get_params, init_drafter, set_params
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.model import block_token_ids, crop, init_cache
from dflash_jax.layers import RopeConfig

D, V, N_TARGET, S = 32, 64, 6, 4


TARGET = StubTarget(
    stub_target_config(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=48,
        num_layers=N_TARGET,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
)


def make_config(**kw):
    base = dict(num_layers=2, mask_token_id=V - 1, block_size=S, target_layer_ids=(1, 2, 4))
    base.update(kw)
    return DrafterConfig.for_target(TARGET.config, **base)


def make_drafter(seed=0, **kw):
    drafter = init_drafter(make_config(**kw), TARGET, seed)
    # Larger than the 0.02 init so that every path moves the output measurably.
    rng = np.random.default_rng(seed + 100)
    params = jax.tree.map(
        lambda x: np.asarray(x) * 10 if x.ndim > 1 else 1 + 0.3 * rng.normal(size=x.shape),
        get_params(drafter),
    )
    return set_params(drafter, params)


def packed_row_batch():
    """Two packed rows with several documents, padding, and anchors at document starts/ends."""
    T = 48
    docs = [[12, 20, 10], [30, 14]]  # row 0 ends with 6 padding tokens, row 1 with 4
    seg = np.zeros((2, T), np.int32)
    pos = np.zeros((2, T), np.int32)
    for b, lens in enumerate(docs):
        c = 0
        for d, n in enumerate(lens):
            seg[b, c : c + n] = d + 1
            pos[b, c : c + n] = np.arange(n)
            c += n
    anchors = np.array([[0, 5, 11, 12, 20, 31, 32, 44], [0, 3, 17, 29, 30, 36, 43, 45]], np.int32)
    valid = np.ones_like(anchors, bool)
    valid[0, 7] = False  # an anchor in the padding
    valid[1, 7] = False
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V - 1, (2, T)).astype(np.int32)
    feats = rng.normal(size=(2, T, 3 * D)).astype(np.float32)
    return dict(
        ids=jnp.asarray(ids),
        features=jnp.asarray(feats),
        positions=jnp.asarray(pos),
        segment_ids=jnp.asarray(seg),
        anchors=jnp.asarray(anchors),
        anchor_valid=jnp.asarray(valid),
    )


@nnx.jit
def _forward_train(drafter, *args):
    return drafter.forward_train(*args)


@nnx.jit
def infer(drafter, *args):
    return drafter.forward_infer(*args)


def train_forward(drafter, batch, block_embeds=None, **changes):
    b = {**batch, **changes}
    if block_embeds is None:
        block_embeds = drafter.train_block_embeds(TARGET, b["ids"], b["anchors"])
    return _forward_train(
        drafter,
        b["features"],
        b["positions"],
        b["segment_ids"],
        b["anchors"],
        b["anchor_valid"],
        block_embeds,
    )


def changed(a, b, tol=1e-6):
    return float(jnp.max(jnp.abs(a - b))) > tol


# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_training_mode_equals_inference_mode(impl):
    drafter = make_drafter(attention_impl=impl, anchor_chunk=3)
    batch = packed_row_batch()
    embeds = drafter.train_block_embeds(TARGET, batch["ids"], batch["anchors"])
    hidden = np.asarray(train_forward(drafter, batch, embeds))
    assert np.isfinite(hidden).all()
    seg, pos = np.asarray(batch["segment_ids"]), np.asarray(batch["positions"])
    checked = 0
    for b in range(2):
        for j, a in enumerate(np.asarray(batch["anchors"][b])):
            if not batch["anchor_valid"][b, j]:
                continue
            start = int(np.argmax(seg[b] == seg[b, a]))  # first token of the anchor's document
            n = a - start
            cache = init_cache(drafter.config, 1, 64)
            # The context cut at the anchor, right-padded to a fixed width (one compile).
            ctx = jnp.pad(batch["features"][b : b + 1, start:a], ((0, 0), (0, 48 - n), (0, 0)))
            ctx_pos = jnp.pad(batch["positions"][b : b + 1, start:a], ((0, 0), (0, 48 - n)))
            block_pos = jnp.asarray(pos[b, a] + np.arange(S))[None]
            out, cache = infer(drafter, ctx, ctx_pos, embeds[b, j][None], block_pos, cache, jnp.array([n]))
            np.testing.assert_allclose(hidden[b, j], np.asarray(out[0]), atol=1e-5, rtol=1e-5)
            assert int(cache.lengths[0]) == n
            checked += 1
    assert checked == 14


def test_fc_sees_all_target_layers():
    drafter = make_drafter()
    batch = packed_row_batch()
    with pytest.raises(ValueError, match="fc needs all 3 target layers"):
        train_forward(drafter, batch, features=batch["features"][..., : 2 * D])
    base = train_forward(drafter, batch)
    for k in range(3):  # each of the K slices of the concatenation must reach the output
        feats = batch["features"].at[..., k * D : (k + 1) * D].add(1.0)
        assert changed(train_forward(drafter, batch, features=feats)[0, 1], base[0, 1]), f"slice {k} ignored"


def test_block_sees_strictly_earlier_context_of_its_document():
    drafter = make_drafter()
    batch = packed_row_batch()
    base = train_forward(drafter, batch)
    row, j = 0, 4  # anchor 20 in document 2 (tokens 12..31)
    a = int(batch["anchors"][row, j])
    # The anchor's own context position and everything after it: invisible.
    for p in (a, a + 1, 31, 35):
        feats = batch["features"].at[row, p].add(3.0)
        out = train_forward(drafter, batch, features=feats)
        np.testing.assert_allclose(out[row, j], base[row, j], atol=1e-6, err_msg=f"context {p} leaked")
    # Just before the anchor and the document's first token: visible.
    for p in (a - 1, 12):
        feats = batch["features"].at[row, p].add(3.0)
        assert changed(train_forward(drafter, batch, features=feats)[row, j], base[row, j]), p


def test_documents_do_not_leak():
    drafter = make_drafter()
    batch = packed_row_batch()
    base = train_forward(drafter, batch)
    feats = batch["features"].at[0, :12].add(3.0)  # all of document 1 of row 0
    out = train_forward(drafter, batch, features=feats)
    assert changed(out[0, 1], base[0, 1])  # anchor 5, document 1
    for j in (3, 4, 5, 6):  # anchors of documents 2 and 3
        np.testing.assert_allclose(out[0, j], base[0, j], atol=1e-6, err_msg=f"block {j}")
    np.testing.assert_allclose(out[1], base[1], atol=1e-6)  # the other row


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_blocks_do_not_see_each_other(impl):
    drafter = make_drafter(attention_impl=impl)
    batch = packed_row_batch()
    embeds = drafter.train_block_embeds(TARGET, batch["ids"], batch["anchors"])
    base = train_forward(drafter, batch, embeds)
    out = train_forward(drafter, batch, embeds.at[0, 4].add(1.0))
    assert changed(out[0, 4], base[0, 4])
    others = [j for j in range(8) if j != 4]
    np.testing.assert_allclose(out[0, others], base[0, others], atol=1e-6)


def test_in_block_attention_bidirectional_or_causal():
    batch = packed_row_batch()
    for causal in (False, True):
        drafter = make_drafter(causal_in_block=causal)
        embeds = drafter.train_block_embeds(TARGET, batch["ids"], batch["anchors"])
        base = train_forward(drafter, batch, embeds)
        out = train_forward(drafter, batch, embeds.at[0, 2, S - 1].add(1.0))  # perturb the last slot
        assert changed(out[0, 2, S - 1], base[0, 2, S - 1])
        if causal:
            np.testing.assert_allclose(out[0, 2, : S - 1], base[0, 2, : S - 1], atol=1e-6)
        else:
            assert changed(out[0, 2, 0], base[0, 2, 0]), "slot 0 must see later slots when bidirectional"


def test_slot_positions_are_anchor_plus_k():
    """Slot k is roped at positions[anchor] + k: compare against inference with explicit positions."""
    drafter = make_drafter()
    batch = packed_row_batch()
    embeds = drafter.train_block_embeds(TARGET, batch["ids"], batch["anchors"])
    hidden = train_forward(drafter, batch, embeds)
    b, j = 1, 2  # anchor 17 in a 30-token document starting at 0
    a = int(batch["anchors"][b, j])
    ctx, ctx_pos = batch["features"][b : b + 1, :a], batch["positions"][b : b + 1, :a]
    for shift, same in ((0, True), (1, False), (-1, False)):
        block_pos = jnp.arange(S)[None] + a + shift
        out, _ = infer(
            drafter, ctx, ctx_pos, embeds[b, j][None], block_pos, init_cache(drafter.config, 1, 32)
        )
        assert (float(jnp.max(jnp.abs(out[0] - hidden[b, j]))) < 1e-5) == same, shift


def test_invalid_anchors_finite_and_gradients_finite():
    drafter = make_drafter()
    batch = packed_row_batch()
    batch["anchor_valid"] = batch["anchor_valid"].at[0, :3].set(False)
    graphdef, params = nnx.split(drafter, nnx.Param)

    def loss(params):
        model = nnx.merge(graphdef, params)
        h = train_forward(model, batch)
        w = batch["anchor_valid"][..., None, None]
        return jnp.sum(jnp.where(w, model.logits(h, TARGET), 0.0) ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert np.isfinite(float(value))
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves)
    assert np.isfinite(np.asarray(train_forward(drafter, batch))).all()


def test_shared_weights_are_not_drafter_params():
    drafter = make_drafter()
    params = get_params(drafter)
    assert set(params) == {"fc", "hidden_norm", "layers", "norm"}
    assert all(V not in x.shape for x in jax.tree.leaves(params))
    h = jnp.ones((2, D))
    np.testing.assert_allclose(drafter.logits(h, TARGET), TARGET.logits(h))
    # The noise block goes through the target's own embedding table.
    ids = block_token_ids(jnp.arange(10)[None], jnp.array([[2, 7]]), S, V - 1)
    np.testing.assert_array_equal(ids, [[[2, V - 1, V - 1, V - 1], [7, V - 1, V - 1, V - 1]]])
    np.testing.assert_allclose(drafter.embed_blocks(TARGET, ids), TARGET.embed_table[ids])


def test_batched_cache_with_ragged_rows_and_crop():
    """Batch 2 with different per-row context growth equals each row run alone; crop rolls back."""
    drafter = make_drafter()
    rng = np.random.default_rng(1)
    feats = rng.normal(size=(2, 40, 3 * D)).astype(np.float32)
    blocks = rng.normal(size=(2, S, D)).astype(np.float32)
    steps = [(np.array([6, 8]), 8), (np.array([3, 8]), 8), (np.array([5, 1]), 8)]

    def run(rows, cap=64):
        cache = init_cache(drafter.config, len(rows), cap)
        lengths = np.zeros(len(rows), int)
        outs = []
        for counts, width in steps:
            counts = counts[rows]
            idx = lengths[:, None] + np.arange(width)[None]
            new = np.stack([feats[r, np.minimum(i, 39)] for r, i in zip(rows, idx, strict=True)])
            pos = jnp.asarray(idx, jnp.int32)
            lengths = lengths + counts
            bpos = jnp.asarray(lengths[:, None] + np.arange(S)[None], jnp.int32)
            h, cache = infer(drafter, new, pos, blocks[rows], bpos, cache, jnp.asarray(counts, jnp.int32))
            np.testing.assert_array_equal(cache.lengths, lengths)
            outs.append(h)
        return jnp.stack(outs, 1), cache

    both, cache = run(np.array([0, 1]))
    for r in (0, 1):
        alone, _ = run(np.array([r]))
        np.testing.assert_allclose(both[r], alone[0], atol=1e-5, rtol=1e-5)

    # Rolling back to 10 entries and re-appending the same context gives the same block output.
    short = crop(cache, jnp.array([10, 10]))
    np.testing.assert_array_equal(short.lengths, [10, 10])
    lens = np.asarray(cache.lengths)
    n = lens - 10
    assert (n <= 8).all()  # the same width as the decode steps: no new compile
    idx = 10 + np.arange(8)[None]
    new = np.stack([feats[r, np.minimum(idx[0], 39)] for r in (0, 1)])
    bpos = jnp.asarray(lens[:, None] + np.arange(S)[None], jnp.int32)
    again, _ = infer(
        drafter,
        new,
        jnp.asarray(np.repeat(idx, 2, 0), jnp.int32),
        blocks,
        bpos,
        short,
        jnp.asarray(n, jnp.int32),
    )
    ref, _ = infer(drafter, new, jnp.zeros((2, 8), jnp.int32), blocks, bpos, cache, jnp.zeros(2, jnp.int32))
    np.testing.assert_allclose(again, ref, atol=1e-5, rtol=1e-5)


def test_bf16_compute_close_to_fp32():
    batch = packed_row_batch()
    f32 = train_forward(make_drafter(), batch)
    drafter = make_drafter(compute_dtype="bfloat16")
    bf16 = train_forward(drafter, batch)
    assert bf16.dtype == jnp.bfloat16
    assert get_params(drafter)["fc"].dtype == jnp.float32
    err = float(jnp.max(jnp.abs(bf16.astype(jnp.float32) - f32)))
    assert err < 0.15 * float(jnp.max(jnp.abs(f32))), err
