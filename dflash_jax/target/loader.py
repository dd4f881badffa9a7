"""``load_target``: an HF model directory -> a TargetModel whose weights live on a device mesh."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.sharding import MeshConfig, make_mesh
from dflash_jax.target.config import TargetConfig
from dflash_jax.target.hybrid import build_target_model
from dflash_jax.target.model import TargetModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


def load_target(path: str | Path, *, dtype="float32", mesh: Mesh | None = None) -> TargetModel:
    """Load a Llama / Qwen2 / Qwen3 / Qwen3.5 HF checkpoint directory (config.json + safetensors).

    Weights are read tensor by tensor and placed straight onto ``mesh`` (default: one device)
    with their logical-axis shardings; the checkpoint must match config.json exactly.
    """
    from convert.hf_target import load_weights_into
    from convert.safetensors_io import CheckpointReader

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"target path {path} is not a directory (expected an HF model dir)")
    config = TargetConfig.from_pretrained(path)
    dt = resolve_dtype(dtype)
    reader = CheckpointReader(path)
    if mesh is None:
        mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    t0 = time.perf_counter()
    abstract = nnx.eval_shape(lambda: build_target_model(config, dtype=dt, rngs=nnx.Rngs(0)))
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
