"""One command-line style: ``eval`` and ``regenerate`` read a run config plus ``key=value``
overrides like ``train``; the console scripts of pyproject.toml point at callable entry points."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

from dflash_jax.config_io import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_console_script_is_a_callable_entry_point():
    assert {"dflash-train", "dflash-eval", "dflash-regenerate", "dflash-features"} <= set(SCRIPTS)
    for name, target in SCRIPTS.items():
        module, _, attr = target.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        assert callable(entry), f"{name} -> {target} is not callable"


def test_eval_reads_a_run_config_and_its_own_keys():
    from dflash_jax.eval import parse_args

    _, config = parse_args(["--config", "tiny", "eval.batch_size=2", "target.dtype=bfloat16", "eval.limit=3"])
    assert config.run.target.path == "tiny"
    assert config.run.target.dtype == "bfloat16"  # the run's sections take overrides as train does
    assert config.options.batch_size == 2
    assert config.options.limit == 3


def test_regenerate_reads_a_run_config_and_its_own_keys(tmp_path):
    from dflash_jax.regenerate import parse_args

    args, config = parse_args(
        ["--config", "tiny", "--out", str(tmp_path / "a.jsonl"), "regen.seed=7", "data.enable_thinking=true"]
    )
    assert args.out == str(tmp_path / "a.jsonl")
    assert config.options.seed == 7
    assert config.run.data.enable_thinking is True


@pytest.mark.parametrize("module", ["dflash_jax.eval", "dflash_jax.regenerate"])
def test_an_unknown_key_is_named(module, tmp_path):
    parse_args = importlib.import_module(module).parse_args
    with pytest.raises(ConfigError, match="no_such_key"):
        parse_args(_argv(module, tmp_path))


def test_an_old_flag_names_its_new_spelling():
    from dflash_jax.eval import parse_args

    with pytest.raises(ConfigError, match=r"--prompts is gone.*eval\.prompts="):
        parse_args(["--prompts", "p.jsonl"])


def _argv(module: str, tmp_path) -> list[str]:
    section = "eval" if module.endswith("eval") else "regen"
    out = [] if section == "eval" else ["--out", str(tmp_path / "a.jsonl")]
    return ["--config", "tiny", *out, f"{section}.no_such_key=1"]
