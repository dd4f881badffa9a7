"""Building blocks shared by the target models and the drafter: RMSNorm, RoPE, SwiGLU MLP.

Shapes use named dimensions in einsums: B batch, T length, D model width (embed), N query heads,
K kv heads, H head_dim, F mlp width.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config_io import check_fields


def param(rngs: nnx.Rngs | None, shape, logical_axes, dtype, init="normal", scale=0.02):
    """An nnx.Param carrying its logical axes (used to place it on a mesh)."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(logical_axes))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF-style RMSNorm: normalise in fp32, scale by weight in the input dtype."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, logical_axes=("norm",)):
        self.eps = eps
        self.weight = param(None, (dim,), logical_axes, dtype, init="ones")

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


# --------------------------------------------------------------------------------------------
# Rotary position embeddings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings in HF terms. ``rope_type`` is one of default | linear | llama3 | yarn.

    YaRN (gpt-oss): frequencies blended between interpolated and extrapolated by a linear ramp
    over the dims between the ``beta_fast`` / ``beta_slow`` rotation counts, and cos/sin scaled by
    ``attention_factor`` (None: 0.1 ln(factor) + 1, as transformers infers it)."""

    theta: float = 10000.0
    rope_type: Literal["default", "linear", "llama3", "yarn"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self):
        check_fields(self)
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")

    @classmethod
    def from_hf(cls, hf: dict) -> RopeConfig:
        """Read rope settings from an HF config dict (transformers 4.x and 5.x layouts)."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        if scaling:
            params = {**scaling, **params}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        kw = dict(theta=float(theta), rope_type=rope_type)
        if rope_type == "linear":
            kw["factor"] = float(params["factor"])
        elif rope_type == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in params:
                    raise ValueError(f"llama3 rope scaling needs {key!r} in rope_parameters/rope_scaling")
            kw.update(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        elif rope_type == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if key not in params:
                    raise ValueError(f"yarn rope scaling needs {key!r} in rope_parameters/rope_scaling")
            if params.get("mscale") or params.get("mscale_all_dim"):
                raise ValueError("yarn rope scaling: mscale / mscale_all_dim are not supported")
            kw.update(
                factor=float(params["factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                truncate=bool(params.get("truncate", True)),
            )
            if params.get("attention_factor") is not None:
                kw["attention_factor"] = float(params["attention_factor"])
        return cls(**kw)

    @property
    def scaling(self) -> float:
        """The factor on cos/sin (YaRN's attention factor; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def to_hf(self) -> dict:
        """The transformers-5 ``rope_parameters`` dict (also valid as legacy ``rope_scaling``)."""
        out = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type == "linear":
            out["factor"] = self.factor
        elif self.rope_type == "llama3":
            out.update(
                factor=self.factor,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        elif self.rope_type == "yarn":
            out.update(
                factor=self.factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=self.truncate,
            )
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out


def _yarn_inv_freq(config: RopeConfig, head_dim: int) -> jax.Array:
    """transformers' ``_compute_yarn_parameters`` frequencies (same float32 arithmetic)."""
    base, dim = config.theta, head_dim
    orig = config.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(config.beta_fast), correction_dim(config.beta_slow)
    if config.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (config.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(config: RopeConfig, head_dim: int) -> jax.Array:
    if config.rope_type == "yarn":
        return _yarn_inv_freq(config, head_dim)
    inv_freq = 1.0 / (config.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.factor
    elif config.rope_type == "llama3":
        low_wavelen = config.original_max_position_embeddings / config.low_freq_factor
        high_wavelen = config.original_max_position_embeddings / config.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / config.factor, inv_freq)
        smooth = (config.original_max_position_embeddings / wavelen - config.low_freq_factor) / (
            config.high_freq_factor - config.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / config.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(positions: jax.Array, config: RopeConfig, head_dim: int):
    """cos/sin tables [..., head_dim] for integer positions [...] (HF half-rotation layout)."""
    inv_freq = rope_inv_freq(config, head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([angles, angles], axis=-1)
    if config.scaling != 1.0:
        return jnp.cos(emb) * config.scaling, jnp.sin(emb) * config.scaling
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, H]; cos/sin [B, T, H]. Computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# MLP
# --------------------------------------------------------------------------------------------


def swiglu_mlp(x, gate, up, down, *, gate_bias=None, up_bias=None, down_bias=None, matmul_dtype=None):
    """x [B,T,D]; gate/up [D,F]; down [F,D]; matmul_dtype: see ``project``."""
    g = project("BTD,DF->BTF", x, gate, matmul_dtype)
    u = project("BTD,DF->BTF", x, up, matmul_dtype)
    if gate_bias is not None:
        g = g + gate_bias.astype(x.dtype)
    if up_bias is not None:
        u = u + up_bias.astype(x.dtype)
    y = project("BTF,FD->BTD", jax.nn.silu(g) * u, down, matmul_dtype)
    if down_bias is not None:
        y = y + down_bias.astype(x.dtype)
    return y


def _transposed_specs(spec: str) -> tuple[str, str]:
    """For ``"x,w->y"``: the specs of dx (``"y,w->x"``) and dw (``"x,y->w"``)."""
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _low_precision_project(spec, x, w, dtype):
    out = jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def _low_precision_project_fwd(spec, x, w, dtype):
    return _low_precision_project(spec, x, w, dtype), (x, w)


def _low_precision_project_bwd(spec, dtype, residuals, ct):
    x, w = residuals
    ct, xl, wl = ct.astype(dtype), x.astype(dtype), w.astype(dtype)
    dx_spec, dw_spec = _transposed_specs(spec)
    dx = jnp.einsum(dx_spec, ct, wl, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum(dw_spec, xl, ct, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


_low_precision_project.defvjp(_low_precision_project_fwd, _low_precision_project_bwd)


def project(spec: str, x: jax.Array, w: jax.Array, matmul_dtype=None) -> jax.Array:
    """``einsum(spec, x, w)``: a projection of activations x by a weight w, returned in x's dtype.

    ``matmul_dtype`` (default x's dtype): the dtype the products are formed in (x and w cast to
    it), summed in float32, forward and backward (the backward's cotangent is cast to it too).
    bfloat16 here is what a bfloat16 einsum means, spelled so that XLA's CPU backend takes its
    bfloat16 kernels (~4x its float32 rate on a CPU with AMX, BENCHMARKS.md "bfloat16 matmuls on
    CPU"): a bfloat16 einsum with a bfloat16 result it computes as a float32 dot. Float32
    activations with bfloat16 products is the usual mixed precision of training (float32 weights,
    norms and residual stream). Every index of x and of w must appear in the other input or in
    the output (true of projections): the two transposed einsums of the backward are then well formed.
    """
    dtype = jnp.dtype(matmul_dtype or x.dtype)
    if dtype == jnp.float32 and x.dtype == jnp.float32:
        return jnp.einsum(spec, x, w.astype(x.dtype))
    return _low_precision_project(spec, x, w, dtype)
