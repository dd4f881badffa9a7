"""Device mesh and logical-axis sharding rules.

Every parameter and activation is annotated with *logical* axis names (``embed``, ``heads``, ...).
One table maps logical names to the physical mesh axes ``data``, ``fsdp`` and ``tensor``, so a
layout change is a change of rules, not of model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dflash_jax.config_io import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # MoE expert weights [E, ...]: whole experts spread over the weight-sharding axes (expert
    # parallelism; target/moe.py, docs/mesh.md)
    ("experts", ("fsdp", "tensor")),
    ("features", ("fsdp", "tensor")),  # fc input (K taps x hidden): sharded in any layout
)


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the (data, fsdp, tensor) mesh; -1 for one axis means "all remaining devices"."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    num_devices: int | None = None  # use only the first N devices (None: all)

    @classmethod
    def from_string(cls, text: str) -> MeshConfig:
        """'data=2,tensor=4' (the mesh_experiment syntax): named axes get their sizes, the rest 1."""
        sizes = {}
        for part in str(text).replace(" ", "").split(","):
            if not part:
                continue
            name, eq, value = part.partition("=")
            if not eq or name not in MESH_AXES:
                raise ValueError(
                    f"mesh layout {text!r}: {part!r} must be AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}"
                )
            if name in sizes:
                raise ValueError(f"mesh layout {text!r}: axis {name!r} given twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(
                    f"mesh layout {text!r}: size of {name!r} must be an integer, got {value!r}"
                ) from None
        if not sizes:
            raise ValueError(f"mesh layout {text!r} names no axis")
        return cls(**{a: sizes.get(a, 1) for a in MESH_AXES})

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {self}")
        for name, s in zip(MESH_AXES, sizes, strict=True):
            if s == 0 or s < -1:
                raise ValueError(f"MeshConfig.{name} must be a positive size or -1, got {s}")
        known = int(np.prod([s for s in sizes if s != -1]))
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"MeshConfig {self}: {num_devices} devices not divisible by {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if int(np.prod(sizes)) != num_devices:
            raise ValueError(
                f"MeshConfig {self}: data*fsdp*tensor = {int(np.prod(sizes))} but {num_devices} devices"
            )
        return tuple(sizes)


class LayoutError(ConfigError):
    """A mesh layout that cannot run this batch or model: names the dimension and the mesh axis."""


def check_layout(
    mesh: MeshConfig, available_devices: int, *, batch_rows: int, dims: Sequence[tuple] = ()
) -> tuple[int, int, int]:
    """The one layout check, for a run's mesh and for each layout a plan describes: ``mesh``
    resolved over ``mesh.num_devices`` (else all ``available_devices``), the batch's rows split over
    data x fsdp, and each ``(axis, dimension, size)`` of ``dims`` (``sharded_dims``) divided by its
    mesh axes. Returns the (data, fsdp, tensor) sizes; raises LayoutError naming what does not fit."""
    n = available_devices
    if mesh.num_devices is not None:
        if not 1 <= mesh.num_devices <= available_devices:
            raise LayoutError(
                f"mesh.num_devices={mesh.num_devices} but {available_devices} devices are available"
            )
        n = mesh.num_devices
    try:
        data, fsdp, tensor = mesh.resolve(n)
    except ValueError as e:
        raise LayoutError(
            f"mesh.data={mesh.data}, mesh.fsdp={mesh.fsdp}, mesh.tensor={mesh.tensor} do not fit "
            f"{n} devices ({e}); -1 takes the devices left"
        ) from None
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for axis, dim, value in dims:
        size = int(np.prod([sizes[a] for a in axis.split("*")]))
        if size > 1 and value % size:
            raise LayoutError(
                f"layout {layout_text(mesh)}: mesh axis {axis}={size} does not divide {dim}={value}"
            )
    if batch_rows % (data * fsdp):
        raise LayoutError(
            f"data.batch_size={batch_rows} rows cannot be split over mesh data x fsdp = {data} x {fsdp} = "
            f"{data * fsdp} devices (rows are sharded over both): make data.batch_size a multiple of "
            f"{data * fsdp}, or change mesh.data/mesh.fsdp"
        )
    return data, fsdp, tensor


def sharded_dims(target_config, drafter_config) -> list[tuple[str, str, int]]:
    """(mesh axis, dimension, size) of every model dimension a layout splits evenly for the plans
    (``DEFAULT_RULES``). A run places a dimension that does not divide replicated (``spec_fits``);
    the planner refuses such a layout, which wastes its axis."""
    t, d = target_config, drafter_config
    dims = [
        ("tensor", "num_heads (target)", t.num_heads),
        ("tensor", "num_kv_heads (target)", t.num_kv_heads),
        ("tensor", "intermediate_size (target)", t.intermediate_size),
        ("tensor", "num_heads (drafter)", d.num_heads),
        ("tensor", "num_kv_heads (drafter)", d.num_kv_heads),
        ("tensor", "intermediate_size (drafter)", d.intermediate_size),
        ("fsdp", "hidden_size", t.hidden_size),
    ]
    if t.is_hybrid:  # Gated DeltaNet: q|k|v channels split by key head (value heads follow)
        dims.insert(3, ("tensor", "linear_num_key_heads (target)", t.linear_num_key_heads))
    if getattr(t, "is_moe", False):  # whole experts over fsdp x tensor (target/moe.py, docs/mesh.md)
        dims.insert(3, ("fsdp*tensor", "num_experts (target)", t.num_experts))
    return dims


def layout_text(config: MeshConfig) -> str:
    """'data=2,tensor=4': the axes of a layout that are not 1."""
    return ",".join(f"{a}={getattr(config, a)}" for a in MESH_AXES if getattr(config, a) != 1) or "data=1"


def make_mesh(config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (sharding constraints are honoured by XLA)."""
    config = config or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    if config.num_devices is not None:
        if not 1 <= config.num_devices <= len(devices):
            raise ValueError(
                f"mesh.num_devices={config.num_devices} but {len(devices)} devices are available"
            )
        devices = devices[: config.num_devices]
    shape = config.resolve(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(
    logical_axes: Sequence[str | None] | None, rules=DEFAULT_RULES, mesh: Mesh | None = None
) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once per spec."""
    if logical_axes is None:
        return PartitionSpec()
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"no sharding rule for logical axis {name!r}")
        target = table[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1))
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def spec_fits(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes that do not divide the dimension they shard (e.g. 3 kv heads on 2 devices)."""
    out = []
    for i, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        out.append(entry if size == 1 or shape[i] % size == 0 else None)
    return PartitionSpec(*out)


def named_sharding(
    mesh: Mesh, logical_axes: Sequence[str | None] | None, shape: Sequence[int], rules=DEFAULT_RULES
) -> NamedSharding:
    return NamedSharding(mesh, spec_fits(logical_to_spec(logical_axes, rules, mesh), shape, mesh))


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None], rules=DEFAULT_RULES) -> NamedSharding:
    """A NamedSharding by logical names with no shape fitting: for arrays assembled from
    per-process pieces (batches), whose dimensions must divide the mesh axes they map to."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh))


# A packed batch: rows over the data axes, tokens whole on each device.
BATCH_AXES = ("batch", "length")


def shard_module(module, mesh: Mesh, rules=DEFAULT_RULES):
    """Place every array of an nnx ``module`` on ``mesh`` by its ``logical_axes`` metadata."""
    from flax import nnx

    state = nnx.state(module)
    for _, var in state.flat_state():
        value = var.get_value()
        if not hasattr(value, "shape"):
            continue
        axes = var.get_metadata().get("logical_axes")
        var.set_value(put_global(value, named_sharding(mesh, axes, value.shape, rules)))
    nnx.update(module, state)
    return module


def put_global(value, sharding: NamedSharding) -> jax.Array:
    """``jax.device_put`` that also works in a multi-process run, where ``sharding`` spans other
    processes' devices: every process passes the same full host value and places its own shards."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None = None):
    """with_sharding_constraint by logical names; a no-op outside a mesh context."""
    mesh = mesh or _current_mesh()
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, logical_axes, x.shape))


def mesh_axes(logical_axis: str, rules=DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes a logical axis maps to under ``rules`` (``()``: replicated)."""
    axes = dict(rules)[logical_axis]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def batch_shards(mesh: Mesh | None = None, rules=DEFAULT_RULES) -> int:
    """How many pieces the ``batch`` logical axis splits into on ``mesh`` (the current one by
    default; 1 outside a mesh): data x fsdp under ``DEFAULT_RULES``."""
    mesh = mesh or _current_mesh()
    if mesh is None:
        return 1
    axes = dict(rules)["batch"]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([mesh.shape.get(a, 1) for a in axes]))


def _current_mesh() -> Mesh | None:
    try:
        m = jax.sharding.get_abstract_mesh()
    except Exception:  # noqa: BLE001 - older/newer jax without an abstract mesh API
        return None
    if m is None or m.empty:
        return None
    return m
