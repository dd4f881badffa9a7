"""Loading models from disk: ``load_target`` (an HF model directory onto a device mesh) and
``load_drafter`` (one of our checkpoints or an HF drafter directory).

This sits above the model code (``target/``, ``drafter/``) and the formats (``convert/``,
``dflash_jax.checkpoint``), so the model code never imports a file format.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from convert.drafter_reader import read_drafter
from convert.hf_target import load_weights_into
from convert.safetensors_io import CheckpointReader
from dflash_jax.drafter.api import set_params, target_config_of
from dflash_jax.drafter.model import DFlashDrafter
from dflash_jax.dtypes import to_dtype
from dflash_jax.sharding import MeshConfig, make_mesh
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.hybrid import build_target_model
from dflash_jax.target.model import TargetModel

log = logging.getLogger(__name__)


def load_target(
    path: str | Path, *, dtype="float32", mesh: Mesh | None = None, attention_impl: str = "auto"
) -> TargetModel:
    """Load a Llama / Qwen2 / Qwen3 / Qwen3.5 HF checkpoint directory (config.json + safetensors).

    Weights are read tensor by tensor and placed straight onto ``mesh`` (default: one device)
    with their logical-axis shardings; the checkpoint must match config.json exactly.
    ``attention_impl``: the target's attention, ``auto`` | ``xla`` | ``pallas`` (``target/attention.py``).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"target path {path} is not a directory (expected an HF model dir)")
    config = TargetConfig.from_pretrained(path)
    dt = to_dtype(dtype)
    reader = CheckpointReader(path)
    if mesh is None:
        mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    t0 = time.perf_counter()
    abstract = nnx.eval_shape(
        lambda: build_target_model(config, dtype=dt, rngs=nnx.Rngs(0), attention_impl=attention_impl)
    )
    model = load_weights_into(abstract, reader, config, mesh, dt)
    model.mesh = mesh
    log.info(
        "loaded %s target (%d layers) from %s in %.1fs",
        config.model_type,
        config.num_layers,
        path,
        time.perf_counter() - t0,
    )
    return model


def load_drafter(path: str | Path, target, *, step: int | None = None, **overrides) -> DFlashDrafter:
    """Load a drafter from one of our orbax checkpoints (a run dir, its ``checkpoints/`` dir or a
    ``<step>`` dir; ``step`` picks one, default the latest) or an HF directory (z-lab or
    speculators layout: config.json + safetensors), via ``convert.drafter_reader.read_drafter``.

    ``overrides`` set our own config fields, e.g. ``attention_impl="reference"`` or
    ``compute_dtype="bfloat16"``. The drafter is checked against ``target`` (model or config)
    on its config, before any weight is read.
    """
    check = None if target is None else (lambda c: c.check_target(target_config_of(target)))
    config, params = read_drafter(path, step=step, check=check, **overrides)
    drafter = nnx.eval_shape(lambda: DFlashDrafter(config, rngs=nnx.Rngs(0)))
    return set_params(drafter, params)
