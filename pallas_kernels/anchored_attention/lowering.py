"""Lowering the kernels for CUDA on a host without a GPU (the CPU pre-flight of the GPU kernels).

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` emits the Triton kernels as custom
calls without compiling them. The Triton lowering needs a target compute capability: jax 0.10.x
falls back to sm_90 when it finds no GPU; jax 0.11.x raises "No supported GPU devices found"
unless an abstract GPU device is set, which ``lower_for_cuda`` does (``device_kind`` names it, e.g.
``"NVIDIA H100"`` for sm_90, ``"NVIDIA A100"`` for sm_80).
"""

from __future__ import annotations

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"
DEFAULT_DEVICE_KIND = "NVIDIA H100"


def abstract_gpu_mesh(
    device_kind: str = DEFAULT_DEVICE_KIND,
    num_cores: int = 132,
    axis_sizes: tuple[int, ...] = (1,),
    axis_names: tuple[str, ...] = ("gpu",),
):
    """An abstract mesh of GPUs of kind ``device_kind`` (no GPU needed): one device by default,
    or e.g. ``(2, 2, 2), ("data", "fsdp", "tensor")`` to lower a program sharded over eight."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    return AbstractMesh(axis_sizes, axis_names, (AxisType.Auto,) * len(axis_names), abstract_device=device)


def lower_for_cuda(f, *args, device_kind: str = DEFAULT_DEVICE_KIND, mesh=None) -> str:
    """StableHLO text of ``jax.jit(f)`` lowered for CUDA at ``args`` (arrays or ShapeDtypeStructs,
    whose shardings name ``mesh``'s axes when one is given: ``abstract_gpu_mesh``)."""
    with jax.sharding.use_abstract_mesh(mesh if mesh is not None else abstract_gpu_mesh(device_kind)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
