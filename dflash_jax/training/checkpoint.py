"""Orbax checkpoints of a training run: drafter params, optimizer state, step, data-iterator
state and the resolved config. Saves are asynchronous; keep-last-N is orbax's ``max_to_keep``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, drafter, optimizer, data_state: dict | None, config: dict, *, force=False):
        state = {
            "params": nnx.to_pure_dict(nnx.state(drafter, nnx.Param)),
            "opt": nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState)),
        }
        extra = {"step": int(step), "data_state": _jsonable(data_state)}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(extra),
                config=ocp.args.JsonSave(config),
            ),
            force=force,
        )

    def wait(self):
        self.manager.wait_until_finished()

    def restore(self, drafter, optimizer, step: int | None = None, mesh=None) -> dict:
        """Restore a run (params and optimizer state) in place; returns the meta dict. To read
        only a drafter's params use ``dflash_jax.load_drafter`` (convert.drafter_to_hf).

        Arrays come back with the shardings the live ones have; with ``mesh``, ones that are not
        on it (optax's scalar counters) come back replicated on it."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = {
            "params": _abstract(nnx.state(drafter, nnx.Param), mesh),
            "opt": _abstract(nnx.state(optimizer, nnx.optimizer.OptState), mesh),
        }
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                meta=ocp.args.JsonRestore(),
            ),
        )
        _assign(drafter, nnx.Param, restored.state["params"])
        _assign(optimizer, nnx.optimizer.OptState, restored.state["opt"])
        return dict(restored.meta)

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def read_config(directory: str | Path, step: int | None = None) -> dict:
    """The resolved run config stored with a checkpoint (no arrays are read)."""
    directory = Path(directory)
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"no checkpoint steps in {directory}")
    step = steps[-1] if step is None else step
    cfg = directory / str(step) / "config" / "metadata"
    if not cfg.is_file():
        raise FileNotFoundError(f"checkpoint {directory / str(step)} has no stored config")
    return json.loads(cfg.read_text())


def _abstract(state, mesh=None):
    def one(x):
        sharding = getattr(x, "sharding", None)
        if mesh is not None and not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
            sharding = NamedSharding(mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, nnx.to_pure_dict(state))


def _assign(module, var_type, pure):
    state = nnx.state(module, var_type)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(module, state)


def _jsonable(obj):
    if obj is None:
        return None
    return json.loads(
        json.dumps(obj, default=lambda o: o.decode("latin1") if isinstance(o, bytes) else str(o))
    )
