"""``layers.project``: a projection whose products are formed in ``matmul_dtype`` (bfloat16: the
dtype XLA's CPU backend has fast kernels for) and summed in float32, forward and backward,
against a NumPy transcription of that contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax.layers import project
from dflash_jax.training.assembly import assemble
from dflash_jax.training.run_config import load_run_config


def _bf16(a) -> np.ndarray:
    """a rounded to bfloat16, as float64 (the products of two of them are exact in float64)."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize(
    "spec, x_shape, w_shape",
    [
        ("BTD,DNH->BTNH", (2, 5, 12), (12, 3, 4)),  # q projection
        ("BTNH,NHD->BTD", (2, 5, 3, 4), (3, 4, 12)),  # o projection (two contracted indices)
        ("...D,DN->...N", (2, 5, 12), (12, 7)),  # a vocabulary head over any leading shape
    ],
)
def test_bfloat16_products_of_float32_activations_forward_and_backward(spec, x_shape, w_shape):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, jnp.float32)
    w = jax.random.normal(kw, w_shape, jnp.float32)
    y, vjp = jax.vjp(lambda x, w: project(spec, x, w, "bfloat16"), x, w)
    ct = jax.random.normal(kc, y.shape, jnp.float32)
    dx, dw = vjp(ct)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32

    # NumPy: every operand rounded to bfloat16 (the cotangent too), products summed exactly.
    ref = spec.replace("...", "BT")  # NumPy sums no ellipsis away: name the leading axes
    inputs, out = ref.split("->")
    xs, ws = inputs.split(",")
    xb, wb, cb = _bf16(x), _bf16(w), _bf16(ct)
    np.testing.assert_allclose(np.asarray(y), np.einsum(ref, xb, wb), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(dx), np.einsum(f"{out},{ws}->{xs}", cb, wb), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(dw), np.einsum(f"{xs},{out}->{ws}", xb, cb), rtol=2e-6, atol=2e-6)
    # ...which is not float32 arithmetic: the bfloat16 rounding is really there
    assert (
        np.abs(np.asarray(y) - np.einsum(ref, np.asarray(x, np.float64), np.asarray(w, np.float64))).max()
        > 1e-3
    )


def test_float32_is_a_plain_einsum_and_bfloat16_activations_stay_bfloat16():
    x = jax.random.normal(jax.random.key(1), (3, 4, 8), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (8, 6), jnp.float32)
    np.testing.assert_array_equal(project("BTD,DF->BTF", x, w), jnp.einsum("BTD,DF->BTF", x, w))
    xb = x.astype(jnp.bfloat16)
    y = project("BTD,DF->BTF", xb, w)  # matmul_dtype defaults to the activations' dtype
    assert y.dtype == jnp.bfloat16
    expected = np.einsum("BTD,DF->BTF", _bf16(x), _bf16(w)).astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(np.asarray(y, np.float32), expected.astype(np.float32), rtol=1e-2)
    dx = jax.grad(lambda x: project("BTD,DF->BTF", x, w).astype(jnp.float32).sum())(xb)
    assert dx.dtype == jnp.bfloat16


def test_training_forms_the_drafters_products_in_train_compute_dtype(tmp_path):
    for dtype in ("bfloat16", "float32"):
        cfg = load_run_config("tiny", [f"output_dir={tmp_path / dtype}", f"train.compute_dtype={dtype}"])
        dcfg = assemble(cfg, run_dir=tmp_path / dtype).drafter_config
        assert (dcfg.matmul_dtype, dcfg.compute_dtype, dcfg.param_dtype) == (dtype, "float32", "float32")
