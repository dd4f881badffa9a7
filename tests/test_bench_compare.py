"""``python -m dflash_jax.bench compare ... --small``: every comparison runs ours and the PyTorch
reference and reports finite, positive medians and ratios (timings are not asserted)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("dflash.model")


def finite(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.slow  # minutes of compiles on 2 cores; a benchmark smoke test
def test_compare_all_small(tmp_path, capsys):
    from dflash_jax.tools.bench import main

    md = tmp_path / "compare.md"
    assert (
        main(
            [
                "compare",
                "all",
                "--small",
                "--repeats",
                "1",
                "--impls",
                "reference",
                "xla",
                "--markdown",
                str(md),
            ]
        )
        == 0
    )
    import json

    out = json.loads(capsys.readouterr().out)
    assert finite(out["matmul_peak"]["jax_gflops"]) and finite(out["matmul_peak"]["torch_gflops"])
    for key in ("target", "drafter-step"):
        r = out[key]
        assert finite(r["ours_s"]) and finite(r["ref_s"]) and finite(r["ratio_ref_over_ours"]), key
        assert finite(r["ours_gflops"]), key
    shapes = out["matmuls"]["shapes"]
    assert set(shapes) >= {"q, o", "k, v", "gate, up", "down", "lm_head (loss chunk)", "lm_head pullback"}
    assert all(finite(r["ours_gflops"]) and finite(r["ratio_ref_over_ours"]) for r in shapes.values())
    # Same weights, batch, anchors and loss on both sides: the loss before the first update agrees.
    r = out["drafter-step"]
    assert abs(r["first_loss_ours"] - r["first_loss_ref"]) < 1e-4 * abs(r["first_loss_ref"])
    e = out["eval"]
    assert e["same_tokens_as_zlab"] is True
    for name in ("spec", "greedy"):
        assert finite(e[name]["ours_ms_per_token"]) and finite(e[name]["ratio_ref_over_ours"])
    a = out["attention"]
    assert finite(a["xla"]["ratio_reference_over_impl"])
    text = md.read_text()
    assert "target fwd vs transformers" in text and "speculative vs z-lab" in text
    assert "matmul alone: gate, up" in text
    assert text.count("\n| ") >= 12  # header + target + 6 matmuls + step + 2 eval + 2 attention rows


def test_markdown_command_repeats_every_non_default_option():
    """BENCHMARKS.md tables carry the command that made them: shapes changed from their defaults
    must appear in it (a table measured with --prompts 2 --new 32 must not read as the default)."""
    import argparse

    from dflash_jax.tools.bench_compare import add_parser, command_line

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["compare", "all", "--prompts", "2", "--new", "64", "--profile",
                              "--impls", "xla", "pallas"])  # fmt: skip
    cmd = command_line(args)
    assert cmd.startswith("python -m dflash_jax.bench compare all --profile --repeats 3")
    assert "--prompts 2" in cmd and "--new 64" in cmd and "--impls xla pallas" in cmd
    assert "--rows" not in cmd and "--small" not in cmd  # defaults are left out
    default = command_line(parser.parse_args(["compare", "target"]))
    assert default == "python -m dflash_jax.bench compare target --repeats 3"
