"""Parity against z-lab's reference drafter (``dflash.model.DFlashDraftModel``, torch, CPU, fp32).

Random z-lab weights are saved in z-lab's HF format and loaded with ``load_drafter``; both models
get the same target features, noise embeddings and positions. Checked: one draft call after a
long context; a multi-step decode replaying ``dflash_generate``'s cache/crop sequence; packed
training mode against the reference fed an explicit invariant-3 mask; our exporter read back by
the reference; strict key accounting of the loader.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dflash_model = pytest.importorskip("dflash.model")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from fixtures import stub_target_config  # noqa: E402
from flax import nnx  # noqa: E402
from hf_fixtures import zlab_drafter_config  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from convert.zlab_drafter import WEIGHTS_FILE, write_zlab_drafter  # noqa: E402
from dflash_jax.drafter.api import get_params, init_drafter, set_params  # noqa: E402
from dflash_jax.drafter.model import crop, init_cache  # noqa: E402
from dflash_jax.loading import load_drafter  # noqa: E402

D, KD, V, S = 64, 3 * 64, 128, 8
LAYER_IDS = [1, 3, 4]
TARGET = types.SimpleNamespace(config=stub_target_config(hidden_size=D, vocab_size=V, num_layers=6))
VARIANTS = {
    "full": {},
    # A sliding layer (z-lab: causal in the block by default), window smaller than the context.
    "sliding": dict(
        layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=24
    ),
}


def zlab_config(**extra):
    return zlab_drafter_config(
        mask_token_id=V - 1,
        target_layer_ids=LAYER_IDS,
        num_target_layers=6,
        block_size=S,
        hidden_size=D,
        vocab_size=V,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **extra,
    )


def randomize_(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def zlab(request, tmp_path_factory):
    model = randomize_(
        dflash_model.DFlashDraftModel(zlab_config(**VARIANTS[request.param])).float().eval(), 0
    )
    path = tmp_path_factory.mktemp(f"zlab_{request.param}")
    model.save_pretrained(path)
    return types.SimpleNamespace(name=request.param, model=model, path=path)


@nnx.jit
def infer(drafter, *args):
    return drafter.forward_infer(*args)


def zlab_call(model, feats, noise, positions, cache=None):
    with torch.no_grad():
        out = model(
            target_hidden=torch.from_numpy(feats),
            noise_embedding=torch.from_numpy(noise),
            position_ids=torch.from_numpy(positions).long(),
            past_key_values=cache,
            use_cache=cache is not None,
        )
    return out.numpy()


def draft_after_context(drafter, rng, C):
    """One draft block after a context of C random target features (a fresh cache) -> (the
    drafter's output, its cache, (features, noise embeddings, positions) for the reference)."""
    feats = rng.normal(size=(1, C, KD)).astype(np.float32)
    noise = rng.normal(size=(1, S, D)).astype(np.float32)
    pos = np.arange(C + S)[None]
    out, cache = infer(
        drafter,
        jnp.asarray(feats),
        jnp.asarray(pos[:, :C]),
        jnp.asarray(noise),
        jnp.asarray(pos[:, C:]),
        init_cache(drafter.config, 1, 256),
    )
    return out, cache, (feats, noise, pos)


def test_loaded_config_mirrors_zlab(zlab):
    drafter = load_drafter(zlab.path, TARGET)
    cfg, ref = drafter.config, zlab.model
    assert list(cfg.target_layer_ids) == list(ref.target_layer_ids)
    assert (cfg.block_size, cfg.mask_token_id) == (ref.block_size, ref.mask_token_id)
    for i, layer in enumerate(ref.layers):
        assert cfg.layer_causal(i) == layer.self_attn.is_causal
        assert cfg.layer_window(i) == layer.self_attn.sliding_window


def test_one_draft_after_long_context(zlab):
    drafter = load_drafter(zlab.path, TARGET)
    rng = np.random.default_rng(1)
    C = 160
    out, cache, (feats, noise, pos) = draft_after_context(drafter, rng, C)
    assert int(cache.lengths[0]) == C
    np.testing.assert_allclose(
        np.asarray(out), zlab_call(zlab.model, feats, noise, pos), atol=1e-5, rtol=1e-5
    )


def test_multistep_decode_with_cache_and_crop(zlab):
    """Replays dflash_generate: the context grows by the accepted count, block positions start at
    the new length, the reference crops its cache back to the context after each draft; one step
    also rolls both caches back (a rejected speculation)."""
    drafter = load_drafter(zlab.path, TARGET)
    rng = np.random.default_rng(2)
    prompt, width, total = 150, 152, 400
    feats = rng.normal(size=(1, total, KD)).astype(np.float32)
    ref_cache = dflash_model._make_cache(zlab.model.config)
    cache = init_cache(drafter.config, 1, 512)
    start, new_from = prompt, 0
    for step, accepted in enumerate([8, 1, 5, 3, 8, 2, 6]):
        noise = rng.normal(size=(1, S, D)).astype(np.float32)
        pos = np.arange(new_from, start + S)[None]
        ref = zlab_call(zlab.model, feats[:, new_from:start], noise, pos, ref_cache)
        dflash_model._crop_to(ref_cache, start)
        n = start - new_from
        new = np.zeros((1, width, KD), np.float32)
        new[:, :n] = feats[:, new_from:start]
        new_pos = np.zeros((1, width), np.int32)
        new_pos[:, :n] = pos[:, :n]
        out, cache = infer(
            drafter,
            jnp.asarray(new),
            jnp.asarray(new_pos),
            jnp.asarray(noise),
            jnp.asarray(pos[:, n:]),
            cache,
            jnp.array([n], jnp.int32),
        )
        np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5, err_msg=f"step {step}")
        assert int(cache.lengths[0]) == start == ref_cache.get_seq_length()
        new_from, start = start, start + accepted
        if step == 3:  # roll back 4 context entries in both caches, then re-feed them
            new_from -= 4
            dflash_model._crop_to(ref_cache, new_from)
            cache = crop(cache, new_from)


def _packed_rows():
    """One packed row: three documents and padding; anchors at doc starts, inside and at doc ends."""
    T = 96
    seg = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    for d, (lo, hi) in enumerate([(0, 40), (40, 70), (70, 90)]):
        seg[lo:hi] = d + 1
        pos[lo:hi] = np.arange(hi - lo)
    anchors = np.array([0, 17, 39, 40, 58, 70, 89, 93], np.int32)
    valid = seg[anchors] > 0
    return seg, pos, anchors, valid


def test_packed_training_mode_matches_zlab_with_explicit_mask(zlab):
    """All blocks of a packed row at once vs the reference run on [context ; all blocks] with the
    invariant-3 mask written out densely and slot positions anchor + k."""
    if zlab.name != "full":
        pytest.skip("the reference takes an explicit mask only as a whole; full-attention layers suffice")
    seg, pos, anchors, valid = _packed_rows()
    T, A = len(seg), len(anchors)
    rng = np.random.default_rng(3)
    feats = rng.normal(size=(1, T, KD)).astype(np.float32)
    noise = rng.normal(size=(1, A, S, D)).astype(np.float32)
    slot_pos = pos[anchors][:, None] + np.arange(S)[None]
    visible = np.zeros((A * S, T + A * S), bool)
    for j, a in enumerate(anchors):
        rows = slice(j * S, (j + 1) * S)
        if valid[j]:
            visible[rows, :T] = (seg == seg[a]) & (np.arange(T) < a)
        visible[rows, T + j * S : T + (j + 1) * S] = True
    with torch.no_grad():
        ref = (
            zlab.model(
                target_hidden=torch.from_numpy(feats),
                noise_embedding=torch.from_numpy(noise.reshape(1, A * S, D)),
                position_ids=torch.from_numpy(np.concatenate([pos, slot_pos.reshape(-1)])[None]).long(),
                attention_mask=torch.from_numpy(visible)[None, None],
            )
            .numpy()
            .reshape(A, S, D)
        )
    for impl in ("reference", "xla"):
        drafter = load_drafter(zlab.path, TARGET, attention_impl=impl, anchor_chunk=3)
        out = nnx.jit(lambda m, *a: m.forward_train(*a))(
            drafter,
            jnp.asarray(feats),
            jnp.asarray(pos)[None],
            jnp.asarray(seg)[None],
            jnp.asarray(anchors)[None],
            jnp.asarray(valid)[None],
            jnp.asarray(noise),
        )
        np.testing.assert_allclose(np.asarray(out[0])[valid], ref[valid], atol=1e-5, rtol=1e-5, err_msg=impl)


def test_exported_drafter_loads_in_zlab(zlab, tmp_path):
    """Our writer -> z-lab's from_pretrained: same config semantics, same outputs."""
    source = load_drafter(zlab.path, TARGET)
    drafter = init_drafter(source.config, TARGET, 5)
    rng = np.random.default_rng(4)
    params = jax.tree.map(
        lambda x: np.asarray(x) * 7 if x.ndim > 1 else 0.5 + rng.random(x.shape), get_params(drafter)
    )
    set_params(drafter, params)
    write_zlab_drafter(tmp_path, drafter.config, get_params(drafter), dtype="float32")
    ref_model = dflash_model.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert list(ref_model.target_layer_ids) == list(drafter.config.target_layer_ids)
    assert (ref_model.block_size, ref_model.mask_token_id) == (S, V - 1)
    for i, layer in enumerate(ref_model.layers):
        assert layer.self_attn.is_causal == drafter.config.layer_causal(i)
        assert layer.self_attn.sliding_window == drafter.config.layer_window(i)
    out, _, (feats, noise, pos) = draft_after_context(drafter, rng, 130)
    np.testing.assert_allclose(np.asarray(out), zlab_call(ref_model, feats, noise, pos), atol=1e-5, rtol=1e-5)
    # And bf16 export: the written file really is bf16 and reloads close to the original.
    write_zlab_drafter(tmp_path / "bf16", drafter.config, get_params(drafter))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert str(load_file(tmp_path / "bf16" / WEIGHTS_FILE)["fc.weight"].dtype) == "bfloat16"


def test_loader_strict_key_accounting(zlab, tmp_path):
    from safetensors.numpy import save_file

    if zlab.name != "full":
        pytest.skip("one variant is enough")
    tensors = load_file(zlab.path / WEIGHTS_FILE)
    config = (zlab.path / "config.json").read_text()

    def write(name, ts):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(config)
        save_file(ts, d / "model.safetensors")
        return d

    missing = {k: v for k, v in tensors.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensors: layers\.1\.mlp\.up_proj\.weight"):
        load_drafter(write("missing", missing), TARGET)
    extra = {**tensors, "lm_head.weight": np.zeros((V, D), np.float32)}
    with pytest.raises(ValueError, match=r"unexpected tensors: lm_head\.weight"):
        load_drafter(write("extra", extra), TARGET)
    bad = {**tensors, "fc.weight": np.zeros((D, 2 * D), np.float32)}
    with pytest.raises(ValueError, match=r"'fc\.weight' has shape \(64, 128\)"):
        load_drafter(write("shape", bad), TARGET)
    wrong_target = types.SimpleNamespace(config=stub_target_config(hidden_size=D, vocab_size=V, num_layers=8))
    with pytest.raises(ValueError, match="target_num_layers=6"):
        load_drafter(zlab.path, wrong_target)
