"""Training metrics: a JSONL log, TensorBoard event files and a final PNG of loss and streak."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import numpy as np


class MetricLogger:
    """Appends to ``metrics.jsonl``; ``resume_step`` first drops rows logged after that step (a
    killed run logs steps its last checkpoint does not hold: the resumed run logs them again)."""

    def __init__(self, directory: str | Path, *, tensorboard: bool = True, resume_step: int | None = None):
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
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1  # TensorBoard's own truncation
            self._tb = SummaryWriter(str(self.directory / "tensorboard"), purge_step=purge)

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
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:
                self._abandon_tensorboard()
                raise OSError(
                    e.errno, f"cannot write {self.directory / 'tensorboard'} ({e.strerror or e})"
                ) from None


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
    """Metrics sink of processes other than 0 (process 0 writes metrics.jsonl and TensorBoard)."""

    def log(self, step, metrics, prefix="train"):
        pass

    def close(self):
        pass
