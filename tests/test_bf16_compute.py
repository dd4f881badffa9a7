"""bfloat16 drafter compute (``train.activation_dtype``): activations and the attention kernel's
inputs in bfloat16, weights, gradients and optimizer state in float32, and a loss and gradients
close to the float32 step's; ``auto`` is bfloat16 only on a GPU, so CPU runs stay as they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fixtures import tiny_target_config
from flax import nnx

from dflash_jax import dtypes
from dflash_jax.config_io import ConfigError
from dflash_jax.drafter import attention as drafter_attention
from dflash_jax.drafter.api import init_drafter
from dflash_jax.drafter.build import build_drafter_config
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.target.model import TargetModel
from dflash_jax.training.assembly import assemble
from dflash_jax.training.run_config import DrafterSection, TrainSection, load_run_config
from dflash_jax.training.step import apply_train_step, drafter_loss, make_optimizer
from pallas_kernels.anchored_attention import api, validated

B = 4  # block size
BF16 = dict(compute_dtype="bfloat16", matmul_dtype="bfloat16")


def _setup(head_dim=8):
    tc = tiny_target_config(head_dim=head_dim)
    target = TargetModel(tc, rngs=nnx.Rngs(0))
    target.embed_tokens[...] = target.embed_tokens[...] * 20.0  # peaked target distributions
    dc = DrafterConfig.for_target(tc, num_layers=2, mask_token_id=255, block_size=B, target_layer_ids=(0, 2))
    return target, dc


def _batch(R=2, T=48):
    rng = np.random.default_rng(0)
    seg = np.ones((R, T), np.int32)
    seg[0, 30:] = 2
    pos = np.where(seg == 2, np.arange(T) - 30, np.arange(T)).astype(np.int32)
    return {
        "input_ids": jnp.asarray(rng.integers(0, 250, (R, T)), jnp.int32),
        "positions": jnp.asarray(pos),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray((pos >= 4).astype(np.int32)),
    }


def _float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


# -- which dtype a run asks for ---------------------------------------------------------------


def test_auto_is_bfloat16_only_on_a_gpu_with_bfloat16_products():
    act = dtypes.activation_dtype
    assert act("auto", "bfloat16", backend="gpu") == "bfloat16"
    assert act("auto", "bfloat16", backend="cuda") == "bfloat16"
    assert act("auto", "bfloat16", backend="cpu") == "float32"  # the CPU recipe: bf16 products only
    assert act("auto", "float32", backend="gpu") == "float32"  # the float32 check path
    assert act("bfloat16", "bfloat16", backend="cpu") == "bfloat16"  # asked for: as asked
    assert act("float32", "bfloat16", backend="gpu") == "float32"


def test_the_run_config_sets_the_drafters_activations(tmp_path, monkeypatch):
    def drafter_dtypes(*overrides):
        cfg = load_run_config("tiny", [f"output_dir={tmp_path}", *overrides])
        d = assemble(cfg, run_dir=tmp_path).drafter_config
        return d.compute_dtype, d.matmul_dtype, d.param_dtype

    bf16_products = "train.compute_dtype=bfloat16"
    assert drafter_dtypes(bf16_products) == ("float32", "bfloat16", "float32")  # CPU: auto is float32
    assert drafter_dtypes(bf16_products, "train.activation_dtype=bfloat16") == (
        "bfloat16",
        "bfloat16",
        "float32",
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert drafter_dtypes(bf16_products) == ("bfloat16", "bfloat16", "float32")
    assert drafter_dtypes("train.compute_dtype=float32") == ("float32", "float32", "float32")


def test_a_warm_start_trains_in_the_runs_dtypes_not_the_sources():
    tc = tiny_target_config()
    source = DrafterConfig.for_target(tc, num_layers=1, mask_token_id=255, param_dtype="bfloat16", **BF16)
    got = build_drafter_config(DrafterSection(), tc, compute_dtype="bfloat16", source=source)
    assert (got.compute_dtype, got.matmul_dtype, got.param_dtype) == ("float32", "bfloat16", "float32")
    got = build_drafter_config(
        DrafterSection(), tc, compute_dtype="bfloat16", activation_dtype="bfloat16", source=source
    )
    assert (got.compute_dtype, got.param_dtype) == ("bfloat16", "float32")


def test_bfloat16_activations_need_bfloat16_products():
    with pytest.raises(
        ConfigError, match=r"train.activation_dtype=bfloat16 needs train.compute_dtype=bfloat16"
    ):
        load_run_config("tiny", ["train.compute_dtype=float32", "train.activation_dtype=bfloat16"])


# -- what reaches the attention ----------------------------------------------------------------


def _forward_jaxpr(drafter, target, batch, anchors):
    def forward(drafter, batch, anchors):
        ids, pos, seg = batch["input_ids"], batch["positions"], batch["segment_ids"]
        out = target(ids, pos, segment_ids=seg, layer_ids=(0, 2), return_logits=False)
        embeds = drafter.train_block_embeds(target, batch["input_ids"], anchors)
        valid = jnp.ones(anchors.shape, bool)
        return drafter.forward_train(
            out.features, batch["positions"], batch["segment_ids"], anchors, valid, embeds
        )

    return jax.make_jaxpr(lambda b, a: forward(drafter, b, a))(batch, anchors)


def _pallas_call_input_dtypes(jaxpr) -> list[set[str]]:
    """The floating input dtypes of every ``pallas_call`` in a jaxpr, nested calls included."""
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(
                    {str(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
                )
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return found


ANCHORS = jnp.asarray([[3, 9, 20, 35], [5, 12, 30, 40]], jnp.int32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kernel_and_the_xla_path_get_the_activation_dtype(dtype, monkeypatch):
    target, dc = _setup(head_dim=16)
    products = "bfloat16" if dtype == "bfloat16" else "float32"
    seen = []
    real = drafter_attention.context_attention

    def spy(q, k, v, *mask, **kw):
        seen.append((kw["impl"], str(q.dtype), str(k.dtype), str(v.dtype)))
        return real(q, k, v, *mask, **kw)

    monkeypatch.setattr(drafter_attention, "context_attention", spy)
    for impl in ("xla", "pallas"):
        drafter = init_drafter(
            dc.replace(attention_impl=impl, compute_dtype=dtype, matmul_dtype=products), target, 0
        )
        jaxpr = _forward_jaxpr(drafter, target, _batch(), ANCHORS)
        if impl == "pallas":  # the kernel's own operands (interpret mode: traced, never run here)
            calls = _pallas_call_input_dtypes(jaxpr)
            assert calls and all(c == {dtype} for c in calls), calls
    assert seen == [(impl, dtype, dtype, dtype) for impl in ("xla", "pallas") for _ in range(dc.num_layers)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_takes_the_validated_bfloat16_kernel_on_a_gpu(dtype, monkeypatch):
    """On a GPU whose validated.json holds the drafter's configuration in bfloat16, ``auto`` calls the
    Pallas kernel for bfloat16 activations and stays on xla for float32 ones (traced, not run)."""
    target, dc = _setup(head_dim=16)
    products = "bfloat16" if dtype == "bfloat16" else "float32"
    drafter = init_drafter(
        dc.replace(attention_impl="auto", compute_dtype=dtype, matmul_dtype=products), target, 0
    )
    entry = {"device_kind": "NVIDIA H200", "head_dim": 16, "groups": 2, "dtype": "bfloat16", "window": False}
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(api.jax, "devices", lambda: [type("Dev", (), {"device_kind": "NVIDIA H200"})()])
    monkeypatch.setattr(validated, "load", lambda path=None: [{**entry, "impl": "pallas"}])
    calls = _pallas_call_input_dtypes(_forward_jaxpr(drafter, target, _batch(), ANCHORS))
    if dtype == "bfloat16":
        assert calls and all(c == {"bfloat16"} for c in calls), calls
    else:
        assert calls == []


# -- the step ---------------------------------------------------------------------------------


def _loss_and_grads(dc, cfg):
    target, _ = _setup()
    drafter = init_drafter(dc, target, 3)
    fn = nnx.value_and_grad(lambda d: drafter_loss(d, target, _batch(), jax.random.key(7), cfg), has_aux=True)
    (loss, _), grads = nnx.jit(fn)(drafter)
    return float(loss), nnx.to_pure_dict(grads)


def test_bf16_loss_and_grads_match_the_fp32_step():
    """bfloat16 activations and products against the float32 step from the same weights: loss within
    0.1 % and gradients within 3 % in norm (measured on this CPU: 4e-5 and 0.85 %; bfloat16 products
    over float32 activations: 2e-5 and 0.55 %), every gradient float32."""
    _, dc = _setup()
    cfg32 = TrainSection(max_anchors=6, loss_chunk=16)
    cfg16 = TrainSection(max_anchors=6, loss_chunk=16, compute_dtype="bfloat16", activation_dtype="bfloat16")
    loss32, g32 = _loss_and_grads(dc, cfg32)
    loss16, g16 = _loss_and_grads(dc.replace(**BF16), cfg16)
    assert {str(x.dtype) for x in _float_leaves(g16)} == {"float32"}
    assert abs(loss16 - loss32) <= 1e-3 * abs(loss32), (loss16, loss32)
    diff = optax.global_norm(jax.tree.map(lambda a, b: a - b, g16, g32))
    norm = optax.global_norm(g32)
    assert float(norm) > 0
    assert float(diff) <= 0.03 * float(norm), (float(diff), float(norm))
    # and it is a bfloat16 step, not the float32 one again
    assert loss16 != loss32


def test_a_bf16_step_keeps_weights_and_optimizer_state_float32():
    target, dc = _setup()
    cfg = TrainSection(max_anchors=6, loss_chunk=16, compute_dtype="bfloat16", activation_dtype="bfloat16")
    drafter = init_drafter(dc.replace(**BF16), target, 3)
    optimizer = nnx.Optimizer(drafter, make_optimizer(cfg), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    step = nnx.jit(lambda d, o, t, b, k: apply_train_step(d, o, t, b, k, cfg, 1e-3))
    metrics = step(drafter, optimizer, target, _batch(), jax.random.key(7))
    assert int(metrics["skipped"]) == 0
    params = nnx.to_pure_dict(nnx.state(drafter, nnx.Param))
    opt_state = nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState))
    assert {str(x.dtype) for x in _float_leaves(params)} == {"float32"}
    assert {str(x.dtype) for x in _float_leaves(opt_state)} == {"float32"}
    moved = max(
        float(np.abs(np.asarray(a) - b).max())
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True)
    )
    assert moved > 0  # the update was applied (to the float32 weights)
