"""``train.report_to``: the real MLflow and Weights & Biases clients (offline) receive the metrics
with the run's config as hyperparameters, and a resume continues the same tracker run."""

from __future__ import annotations

import json
import sys

import pytest

from dflash_jax.config_io import ConfigError
from dflash_jax.training.metrics import TRACKING_FILE, MetricLogger
from dflash_jax.training.run_config import load_run_config

RUN_CONFIG = {"train": {"steps": 5, "learning_rate": 6e-4}, "data": {"sources": ["sharegpt"]}}


def test_mlflow_receives_metrics_and_config_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow-skinny is installed by scripts/setup.sh")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MetricLogger(tmp_path, report_to=("mlflow",), run_config=RUN_CONFIG)
    logger.log(1, {"loss": 2.0, "slot_acc": [0.5, 0.25]})
    logger.log(2, {"loss": 1.5, "slot_acc": [0.6, 0.3]})
    logger.close()
    run_id = json.loads((tmp_path / TRACKING_FILE).read_text())["mlflow"]
    resumed = MetricLogger(tmp_path, report_to=("mlflow",), resume_step=2, run_config=RUN_CONFIG)
    resumed.log(3, {"loss": 1.25})
    resumed.close()
    assert json.loads((tmp_path / TRACKING_FILE).read_text())["mlflow"] == run_id

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.data.params["train.steps"] == "5" and run.data.params["data.sources"] == "['sharegpt']"
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 2.0), (2, 1.5), (3, 1.25)]
    assert [m.value for m in client.get_metric_history(run_id, "train/slot_acc/2")] == [0.25, 0.3]
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume made no second run


def test_wandb_offline_run_is_resumed_by_its_stored_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is installed by scripts/setup.sh")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricLogger(tmp_path, report_to=("wandb",), run_config=RUN_CONFIG)
    logger.log(1, {"loss": 2.0})
    logger.close()
    run_id = json.loads((tmp_path / TRACKING_FILE).read_text())["wandb"]
    resumed = MetricLogger(tmp_path, report_to=("wandb",), resume_step=1, run_config=RUN_CONFIG)
    resumed.log(2, {"loss": 1.0})
    resumed.close()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs)  # one run, twice
    for run in (tmp_path / "wandb").glob("offline-run-*"):
        (record,) = run.glob(f"run-{run_id}.wandb")  # the run's records, to be synced later
        data = record.read_bytes()
        assert b"train.steps" in data and b"train/loss" in data  # the config and the metrics


def test_a_tracker_that_is_not_installed_is_named_with_its_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it fails
    with pytest.raises(ConfigError, match=r"pip install wandb"):
        MetricLogger(tmp_path, report_to=("wandb",))


def test_report_to_is_validated_at_load():
    assert load_run_config("tiny").train.report_to == ("tensorboard",)
    assert load_run_config("tiny", ["train.report_to=[]"]).train.report_to == ()
    with pytest.raises(ConfigError, match="report_to"):
        load_run_config("tiny", ["train.report_to=[neptune]"])
    with pytest.raises(ConfigError, match="twice"):
        load_run_config("tiny", ["train.report_to=[mlflow, mlflow]"])
