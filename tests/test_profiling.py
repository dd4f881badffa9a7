"""The profile summary the benchmarks print: per-op time from a jax.profiler trace, ops named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.tools.profiling import markdown_lines, profile


def test_profile_names_the_ops_where_the_time_goes():
    @jax.jit
    def heavy_then_light(a, b, c):
        return jnp.tanh(a @ b).sum(axis=0), c + 1.0

    a, c = jnp.ones((384, 384)), jnp.ones((8,))
    hlo = heavy_then_light.lower(a, a, c).compile().as_text()

    def call():
        jax.block_until_ready(heavy_then_light(a, a, c))

    call()
    summary = profile(call, hlo_texts=[hlo])
    top = summary["top"]
    assert top and top[0]["module"] == "jit_heavy_then_light"
    assert "dot_general" in top[0]["what"]  # the matmul fusion is named by what it computes
    assert sum(r["share"] for r in top) == pytest.approx(1.0, abs=1e-6)
    assert top[0]["share"] > 0.5
    assert "dot_general" in markdown_lines(summary, "test")[0]
