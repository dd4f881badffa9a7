"""``train.report_to``: the real MLflow and Weights & Biases clients (offline) receive the metrics
with the run's config as hyperparameters, and a resume continues the same tracker run."""

from __future__ import annotations

import json
import os
import re
import subprocess
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


# wandb's client leaves service threads running in the process that used it, so the run happens in a
# child process, as a training run would, and is checked here.
_WANDB_RUN = """
import json
import sys
from pathlib import Path
from dflash_jax.training.metrics import MetricLogger
run_dir, config = Path(sys.argv[1]), json.loads(sys.argv[2])
logger = MetricLogger(run_dir, report_to=("wandb",), run_config=config)
logger.log(1, {"loss": 2.0})
logger.close()
resumed = MetricLogger(run_dir, report_to=("wandb",), resume_step=1, run_config=config)
resumed.log(2, {"loss": 1.0})
resumed.close()
"""


def test_wandb_offline_run_is_resumed_by_its_stored_id(tmp_path):
    pytest.importorskip("wandb", reason="wandb is installed by scripts/setup.sh")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    subprocess.run(
        [sys.executable, "-c", _WANDB_RUN, str(tmp_path), json.dumps(RUN_CONFIG)],
        env=env,
        check=True,
        timeout=300,
    )
    run_id = json.loads((tmp_path / TRACKING_FILE).read_text())["wandb"]
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # one run, twice; wandb adds "-1" to the second directory when both start in the same second
    assert len(runs) == 2 and all(
        re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", n) for n in runs
    )
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
