"""Our orbax checkpoint format, in one place: the trainer's ``Checkpointer`` and the readers and
writers of drafter params that loading and the converters use.

Layout: ``<run>/checkpoints/<step>/`` with three items,

  state    ``{"params": drafter params (+ ``draft_vocab``, int32 target ids, when the drafter
           has a draft vocabulary), "opt": optimizer state}`` (imports have no ``opt``)
  meta     JSON ``{"step", "data_state"}`` (the data iterator's state, for exact resumes)
  config   JSON: the resolved run config, with ``drafter_config`` (``DrafterConfig.to_dict()``) and,
           for a checkpoint made by ``convert.hf_to_drafter``, ``imported_from``

Saves are asynchronous; keep-last-N is orbax's ``max_to_keep``.

The best drafter by validation tau (``BestCheckpoint``) is kept apart, in ``<run>/best/<step>/``
(one step, ``state`` holding only ``params``; its ``meta`` adds ``validation_tau``), so the
rotation of ``checkpoints/`` never deletes it; everything that reads a checkpoint takes
``<run>/best`` as a path.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.model import WEIGHTS, DFlashDrafter

CHECKPOINTS_SUBDIR = "checkpoints"
BEST_SUBDIR = "best"
STATE_ITEM, META_ITEM, CONFIG_ITEM = "state", "meta", "config"
DRAFTER_CONFIG_KEY = "drafter_config"
IMPORT_KEY = "imported_from"


class CheckpointError(ValueError):
    pass


def _save_args(state: dict, step: int, data_state: dict | None, config: dict, extra_meta: dict | None = None):
    meta = {"step": int(step), "data_state": _jsonable(data_state), **(extra_meta or {})}
    return ocp.args.Composite(
        **{
            STATE_ITEM: ocp.args.StandardSave(state),
            META_ITEM: ocp.args.JsonSave(meta),
            CONFIG_ITEM: ocp.args.JsonSave(config),
        }
    )


class Checkpointer:
    """The trainer's checkpoints: drafter params, optimizer state, step, data-iterator state and the
    resolved config, under ``directory/<step>/``."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
                # Step directories are made in the caller's thread, so an unwritable or vanished
                # directory fails that save at once (asynchronously it surfaced two saves later,
                # after minutes waiting on an orbax barrier).
                async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False),
            ),
        )
        self._pending: int | None = None  # the step of the save that may still be writing

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, drafter, optimizer, data_state: dict | None, config: dict, *, force=False):
        """Start an asynchronous save of ``step``. Raises ``FloatingPointError`` (nothing written)
        when a parameter is not finite, and ``OSError`` naming the step when this save, or the
        previous one still writing, failed."""
        params = nnx.to_pure_dict(nnx.state(drafter, WEIGHTS))
        bad = nonfinite_params(params)
        if bad:
            raise FloatingPointError(
                f"refusing to checkpoint step {step}: parameters not finite: {', '.join(bad[:5])}"
            )
        state = {"params": params, "opt": nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState))}
        self.wait()  # the previous save's failure names that save's step, not this one
        try:
            self.manager.save(step, args=_save_args(state, step, data_state, config), force=force)
        except Exception as e:  # noqa: BLE001 - orbax raises many types; name the step and dir
            raise _save_error(step, self.directory, e) from e
        self._pending = step

    def check(self) -> None:
        """Raise ``OSError`` naming the step if the last asynchronous save failed (cheap: the
        trainer calls it after every step, so a failed save stops the run within a step)."""
        if self._pending is None:
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            step, self._pending = self._pending, None
            raise _save_error(step, self.directory, e) from e

    def wait(self) -> None:
        """Block until the last save is written; raise ``OSError`` naming its step if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise _save_error(self._pending, self.directory, e) from e
        self.check()

    def restore(self, drafter, optimizer, step: int | None = None, mesh=None) -> dict:
        """Restore a run (params and optimizer state) in place; returns the meta dict. To read
        only a drafter's params use ``read_drafter_checkpoint`` (or ``dflash_jax.load_drafter``).

        Arrays come back with the shardings the live ones have; with ``mesh``, ones that are not
        on it (optax's scalar counters) come back replicated on it."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = {
            "params": _abstract(nnx.state(drafter, WEIGHTS), mesh),
            "opt": _abstract(nnx.state(optimizer, nnx.optimizer.OptState), mesh),
        }
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                **{STATE_ITEM: ocp.args.StandardRestore(target), META_ITEM: ocp.args.JsonRestore()}
            ),
        )
        _assign(drafter, WEIGHTS, restored[STATE_ITEM]["params"])
        _assign(optimizer, nnx.optimizer.OptState, restored[STATE_ITEM]["opt"])
        return dict(restored[META_ITEM])

    def close(self):
        try:
            self.wait()
        finally:
            self.manager.close()


class BestCheckpoint:
    """The drafter of the best validation-tau measurement so far, in ``directory`` (a run's
    ``best/``): one step, params only, its meta recording the step and ``validation_tau``
    (with ``tau_stderr``, ``num_prompts``, ``method``). A new save replaces the old one."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).resolve()

    def record(self) -> dict | None:
        """The meta of the kept best (``step``, ``validation_tau``, ...), None when there is none."""
        steps = _steps(self.directory)
        if not steps:
            return None
        manager = _manager(self.directory)
        try:
            restored = manager.restore(
                steps[-1], args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
            )
        except Exception as e:  # noqa: BLE001 - orbax raises many types; name the checkpoint
            raise CheckpointError(
                f"cannot read the best checkpoint {self.directory / str(steps[-1])}: {_short(e)}"
            ) from e
        finally:
            manager.close()
        return {k: v for k, v in dict(restored[META_ITEM]).items() if k != "data_state"}

    def save(self, step: int, drafter, config: dict, record: dict) -> None:
        """Keep ``drafter``'s params as the best, at ``step``, with ``record`` (``validation_tau``
        and what it rests on) in its meta; written before this returns, the previous best then
        removed. Raises ``FloatingPointError`` (nothing written) for non-finite parameters."""
        params = nnx.to_pure_dict(nnx.state(drafter, WEIGHTS))
        bad = nonfinite_params(params)
        if bad:
            raise FloatingPointError(
                f"refusing to keep step {step} as the best: parameters not finite: {', '.join(bad[:5])}"
            )
        manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=1, enable_async_checkpointing=False, create=True
            ),
        )
        try:
            # A resume from an earlier step may measure a new best at a step below the kept one.
            for old in manager.all_steps():
                if old >= step:
                    manager.delete(old)
            manager.save(step, args=_save_args({"params": params}, step, None, config, record), force=True)
            manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise _save_error(step, self.directory, e) from e
        finally:
            manager.close()


def nonfinite_params(params: dict) -> list[str]:
    """Dotted names of the parameters holding a NaN or an infinity (empty when all are finite)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [
        ".".join(str(getattr(k, "key", k)) for k in path)
        for path, x in flat
        if jnp.issubdtype(x.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(x)))
    ]


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (the message names the step and the directory)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _save_error(step, directory: Path, e: Exception) -> CheckpointSaveError:
    if isinstance(e, CheckpointSaveError):
        return e
    return CheckpointSaveError(f"checkpoint of step {step} in {directory} failed: {_short(e)}")


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


# ------------------------------------------------------------------------------------------
# Finding and reading a checkpoint's drafter
# ------------------------------------------------------------------------------------------


def _steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def resolve_checkpoint(path: str | Path, step: int | None = None) -> tuple[Path, int]:
    """-> (the directory holding ``<step>/`` subdirectories, the step). Latest step by default.

    Accepts a run directory (with ``checkpoints/``), the ``checkpoints/`` directory itself, or a
    ``<step>`` directory (then ``step`` must be None or equal to it).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {path} is not a directory")
    if (path / STATE_ITEM).is_dir() and path.name.isdigit():
        if step is not None and step != int(path.name):
            raise CheckpointError(f"{path} is the checkpoint of step {path.name}, but step {step} was asked")
        return path.parent, int(path.name)
    root = path / CHECKPOINTS_SUBDIR if _steps(path / CHECKPOINTS_SUBDIR) else path
    steps = _steps(root)
    if not steps:
        raise CheckpointError(
            f"no checkpoint steps in {path} (expected {path}/checkpoints/<step>/ or {path}/<step>/)"
        )
    if step is None:
        return root, steps[-1]
    if step not in steps:
        raise CheckpointError(f"no step {step} in {root}; available steps: {steps}")
    return root, step


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like one of our orbax checkpoints (not an HF directory)."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / CHECKPOINTS_SUBDIR).is_dir():
        return False
    try:
        resolve_checkpoint(path)
    except (FileNotFoundError, CheckpointError):
        return False
    return True


def _short(e: Exception, limit: int = 600) -> str:
    """Orbax errors can print whole trees; keep the start."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _manager(root: Path):
    return ocp.CheckpointManager(root.resolve(), options=ocp.CheckpointManagerOptions(create=False))


def read_checkpoint_config(path: str | Path, step: int | None = None) -> tuple[dict, int]:
    """-> (the JSON config stored with the checkpoint, its step). No arrays are read."""
    root, step = resolve_checkpoint(path, step)
    manager = _manager(root)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()}))
    except Exception as e:  # noqa: BLE001 - orbax raises many types; name the checkpoint
        raise CheckpointError(f"cannot read the config of checkpoint {root / str(step)}: {_short(e)}") from e
    finally:
        manager.close()
    config = dict(restored[CONFIG_ITEM])
    if DRAFTER_CONFIG_KEY not in config:
        raise CheckpointError(
            f"checkpoint {root / str(step)}: its config has no {DRAFTER_CONFIG_KEY!r} (not a drafter checkpoint?)"
        )
    return config, step


def read_checkpoint(
    path: str | Path, step: int | None = None, *, check=None, **overrides
) -> tuple[DrafterConfig, dict, dict]:
    """-> (DrafterConfig, drafter params as a nested dict of numpy arrays, the stored run config).

    Only the drafter parameters are read (the optimizer state is skipped). ``overrides`` replace
    DrafterConfig fields (attention_impl, compute_dtype, ...); ``check(config)`` runs before any
    array is read.
    """
    run_config, step = read_checkpoint_config(path, step)
    config = DrafterConfig.from_dict(run_config[DRAFTER_CONFIG_KEY])
    if overrides:
        config = config.replace(**overrides)
    if check is not None:
        check(config)
    abstract = nnx.eval_shape(lambda: DFlashDrafter(config, rngs=nnx.Rngs(0)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {
        "params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            nnx.to_pure_dict(nnx.state(abstract, WEIGHTS)),
        )
    }
    root, step = resolve_checkpoint(path, step)
    manager = _manager(root)
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    # Only the params: the optimizer state stays on disk.
                    STATE_ITEM: ocp.args.PyTreeRestore(
                        target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=True,
                    )
                }
            ),
        )
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"cannot restore drafter params from {root / str(step)} with the stored drafter_config "
            f"({config.num_layers} layers, hidden {config.hidden_size}, {config.num_target_features} target layers): "
            f"{_short(e)}"
        ) from e
    finally:
        manager.close()
    params = jax.tree.map(np.asarray, restored[STATE_ITEM]["params"])
    return config, params, run_config


def write_checkpoint(
    out: str | Path, config: DrafterConfig, params: dict, *, step: int = 0, extra: dict | None = None
) -> Path:
    """Write ``params`` (no optimizer state) as step ``step`` of ``out/checkpoints``; ``extra`` joins
    the stored config."""
    root = (Path(out) / CHECKPOINTS_SUBDIR).resolve()
    if (root / str(step)).exists():
        raise FileExistsError(f"{root / str(step)} already exists; choose another --out")
    bad = nonfinite_params(params)
    if bad:
        raise FloatingPointError(
            f"refusing to write {root / str(step)}: parameters not finite: {', '.join(bad[:5])}"
        )
    run_config = {DRAFTER_CONFIG_KEY: config.to_dict(), **(extra or {})}
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=True))
    try:
        state = {"params": jax.tree.map(np.asarray, params)}
        manager.save(step, args=_save_args(state, step, None, run_config))
        manager.wait_until_finished()
    finally:
        manager.close()
    return root / str(step)
