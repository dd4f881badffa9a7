"""The one config mechanism: types as schema (Literal choices included), one unknown-key check,
one dtype table, shipped configs as package data, and ``attention_impl: pallas`` gated on the kernel."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import stub_target_config

from dflash_jax.config_io import ConfigError, from_dict
from dflash_jax.data.pipeline import DataConfig
from dflash_jax.drafter import config as drafter_config
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.dtypes import to_dtype
from dflash_jax.training.run_config import TrainSection, load_run_config, shipped_configs


def test_literal_fields_are_checked_at_load_and_at_construction():
    with pytest.raises(ConfigError, match=r"train.loss_weighting: unknown 'flat'; must be one of"):
        load_run_config("tiny", ["train.loss_weighting=flat"])
    with pytest.raises(ConfigError, match=r"TrainSection.compute_dtype: unknown 'float64'"):
        TrainSection(compute_dtype="float64")
    with pytest.raises(ConfigError, match=r"DataConfig.on_bad_record: unknown 'ignore'"):
        DataConfig(on_bad_record="ignore")
    with pytest.raises(ConfigError, match=r"target.dtype: unknown 'int8'"):
        load_run_config("tiny", ["target.dtype=int8"])


def test_one_unknown_key_check_for_every_config():
    for load, key in [
        (lambda: load_run_config("tiny", ["data.batchsize=2"]), "data.batchsize"),
        (lambda: DataConfig.from_dict({"batchsize": 2}), "batchsize"),
        (lambda: DrafterConfig.from_dict({"hidden": 2}), "hidden"),
        (lambda: from_dict(TrainSection, {"stepz": 2}), "stepz"),
    ]:
        with pytest.raises(ConfigError, match=rf"unknown keys \['{key}'\]"):
            load()


def test_nested_sections_load_through_config_io():
    cfg = DrafterConfig.for_target(stub_target_config(), num_layers=2, mask_token_id=5)
    d = cfg.to_dict()
    d["rope"]["rope_type"] = "cubic"
    with pytest.raises(ConfigError, match=r"rope.rope_type: unknown 'cubic'"):
        DrafterConfig.from_dict(d)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_one_dtype_table():
    assert to_dtype("bfloat16").name == "bfloat16" and to_dtype("float16") == np.float16
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        to_dtype("float64")


def test_shipped_configs_are_package_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not found through the working directory
    assert {"tiny", "demo"} <= set(shipped_configs())
    assert load_run_config("tiny.yaml").name == "tiny"
    with pytest.raises(ConfigError, match="one of: demo"):
        load_run_config("nope")


def test_pallas_is_accepted_only_when_the_kernel_imports(monkeypatch):
    monkeypatch.setattr(drafter_config, "PALLAS_KERNEL_MODULE", "pallas_kernels.no_such_kernel")
    with pytest.raises(ConfigError, match=r"drafter.attention_impl='pallas' needs the Pallas kernel"):
        load_run_config("tiny", ["drafter.attention_impl=pallas"])
    with pytest.raises(ConfigError, match=r"DrafterConfig.attention_impl='pallas'"):
        DrafterConfig.for_target(stub_target_config(), num_layers=1, mask_token_id=5, attention_impl="pallas")
    monkeypatch.setattr(drafter_config, "PALLAS_KERNEL_MODULE", "json")  # any importable module
    assert load_run_config("tiny", ["drafter.attention_impl=pallas"]).drafter.attention_impl == "pallas"
