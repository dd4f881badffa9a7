"""Training metrics: a JSONL log (always), the trackers of ``train.report_to`` (TensorBoard event
files by default; Weights & Biases and MLflow where installed, the run's config logged as their
hyperparameters) and a final PNG of loss and streak."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
from pathlib import Path

import numpy as np

from dflash_jax.config_io import ConfigError
from dflash_jax.nested import flatten

TRACKING_FILE = "tracking.json"  # the W&B / MLflow run ids, so a resume continues the same runs


class MetricLogger:
    """Appends to ``metrics.jsonl`` and reports to ``report_to``'s trackers; ``resume_step`` first
    drops rows logged after that step (a killed run logs steps its last checkpoint does not hold:
    the resumed run logs them again). ``run_config`` (the resolved config) is the trackers'
    hyperparameters."""

    def __init__(
        self,
        directory: str | Path,
        *,
        report_to: tuple[str, ...] = ("tensorboard",),
        resume_step: int | None = None,
        run_config: dict | None = None,
    ):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.directory / "metrics.jsonl"
        if resume_step is not None and self.jsonl_path.is_file():
            kept = [r for r in read_metrics(self.jsonl_path) if r["step"] <= resume_step]
            tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a")
        self._tb = None
        if "tensorboard" in report_to:
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1  # TensorBoard's own truncation
            self._tb = SummaryWriter(str(self.directory / "tensorboard"), purge_step=purge)
        params = _hyperparameters(run_config or {})
        self._trackers = [
            {"wandb": _WandbTracker, "mlflow": _MlflowTracker}[name](self.directory, params)
            for name in report_to
            if name != "tensorboard"
        ]

    def log(self, step: int, metrics: dict, prefix: str = "train"):
        flat = {}
        for k, v in metrics.items():
            arr = np.asarray(v)
            if arr.ndim == 0:
                flat[k] = float(arr)
            else:
                for i, x in enumerate(arr.reshape(-1)):
                    flat[f"{k}/{i + 1}" if k == "slot_acc" else f"{k}/{i}"] = float(x)
        record = {"step": int(step), "split": prefix, **flat}
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        except OSError as e:  # a full disk: name the file (the bare errno named nothing)
            raise OSError(e.errno, f"cannot write {self.jsonl_path} ({e.strerror or e})") from None
        finite = {f"{prefix}/{k}": v for k, v in flat.items() if math.isfinite(v)}
        for tracker in self._trackers:
            tracker.log(step, finite)
        if self._tb is not None:
            try:
                for k, v in flat.items():
                    if math.isfinite(v):
                        self._tb.add_scalar(f"{prefix}/{k}", v, step)
                self._tb.flush()
            except OSError as e:
                self._abandon_tensorboard()
                raise OSError(
                    e.errno, f"cannot write {self.directory / 'tensorboard'} ({e.strerror or e})"
                ) from None

    def _abandon_tensorboard(self) -> None:
        """After a failed write, drop TensorBoard's unwritten events: its exit hook would retry the
        flush and print a traceback after our one error line."""
        writers = getattr(self._tb, "all_writers", None) or {}
        for w in writers.values():
            ev = getattr(w, "event_writer", None)
            if ev is not None:
                worker = getattr(ev, "_worker", None)
                if worker is not None:
                    with contextlib.suppress(Exception):
                        worker.stop()
                ev._closed = True
        self._tb = None

    def close(self):
        with contextlib.suppress(OSError):  # the file's own close; a write error was already raised
            self._jsonl.close()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:
                self._abandon_tensorboard()
                raise OSError(
                    e.errno, f"cannot write {self.directory / 'tensorboard'} ({e.strerror or e})"
                ) from None


def _hyperparameters(run_config: dict) -> dict:
    """The resolved config as flat ``section.key`` parameters (sequences as their text)."""
    return {
        k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
        for k, v in flatten(run_config).items()
    }


def _import_tracker(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"train.report_to lists {package.split('-')[0]}, but {module} is not installed: "
            f"pip install {package} (or drop it from train.report_to)"
        ) from None


def check_trackers_installed(report_to: tuple[str, ...]) -> None:
    """Before anything loads: every tracker ``train.report_to`` lists can be imported."""
    for name in report_to:
        if name == "wandb":
            _import_tracker("wandb", "wandb")
        elif name == "mlflow":
            _import_tracker("mlflow", "mlflow-skinny")


def _tracking_ids(directory: Path) -> dict:
    path = directory / TRACKING_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _store_tracking_id(directory: Path, name: str, run_id: str) -> None:
    ids = {**_tracking_ids(directory), name: run_id}
    (directory / TRACKING_FILE).write_text(json.dumps(ids, indent=2))


class _WandbTracker:
    """A Weights & Biases run (``WANDB_PROJECT``, default ``dflash-jax``; ``WANDB_MODE=offline``
    without a login), resumed by the id stored in the run directory."""

    def __init__(self, directory: Path, params: dict):
        wandb = _import_tracker("wandb", "wandb")
        run_id = _tracking_ids(directory).get("wandb") or secrets.token_hex(8)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "dflash-jax"),
            name=directory.name,
            id=run_id,
            resume="allow",
            dir=str(directory),
            config=params,
        )
        _store_tracking_id(directory, "wandb", run_id)

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _MlflowTracker:
    """An MLflow run (``MLFLOW_TRACKING_URI``, default ``<run dir>/mlruns``; experiment
    ``MLFLOW_EXPERIMENT_NAME``, default ``dflash-jax``), resumed by the id stored in the run
    directory."""

    def __init__(self, directory: Path, params: dict):
        mlflow = _import_tracker("mlflow", "mlflow-skinny")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a file store in the run dir: MLflow wants an opt-in for it, given here
            uri = (directory / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        run_id = _tracking_ids(directory).get("mlflow")
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "dflash-jax")
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment, run_name=directory.name).info.run_id
            entities = mlflow.entities
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                batch = list(params.items())[i : i + 100]
                self.client.log_batch(run_id, params=[entities.Param(k, str(v)[:6000]) for k, v in batch])
            _store_tracking_id(directory, "mlflow", run_id)
        self.run_id = run_id

    def log(self, step: int, scalars: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(jsonl_path: str | Path, png_path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    # the validation set's curve and the test set's points before/after training
    taus = {
        split: [r for r in rows if r.get("split") == split and "tau" in r]
        for split in ("validation", "heldout")
    }
    taus = {split: pts for split, pts in taus.items() if pts}
    fig, axes = plt.subplots(1, 3 if taus else 2, figsize=(15 if taus else 10, 3.8))
    for split, style in (("train", "-"), ("heldout", "o--")):
        pts = [r for r in rows if r.get("split") == split and "loss" in r]
        if not pts:
            continue
        steps = [r["step"] for r in pts]
        axes[0].plot(steps, [r["loss"] for r in pts], style, label=split)
        axes[1].plot(steps, [r["streak"] for r in pts], style, label=split)
    axes[0].set_title("loss")
    axes[1].set_title("streak (teacher-forced accepted length)")
    for split, style, label in (("validation", "o-", "validation"), ("heldout", "s", "test")):
        if split in taus:
            axes[2].plot(
                [r["step"] for r in taus[split]], [r["tau"] for r in taus[split]], style, label=label
            )
    if taus:
        axes[2].set_title("held-out tau (accepted tokens per verify step)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


class NullLogger:
    """Metrics sink of processes other than 0 (process 0 writes metrics.jsonl and the trackers)."""

    def log(self, step, metrics, prefix="train"):
        pass

    def close(self):
        pass
