"""Memory and communication plans from AOT compiles on abstract parameters.

Nothing here reads or allocates a weight: the target, the drafter and the optimizer are built with
``nnx.eval_shape``, every leaf becomes a ``jax.ShapeDtypeStruct`` carrying the ``NamedSharding``
its logical axes give on the mesh, and ``jax.jit(...).lower(...).compile()`` yields the per-device
program. From it: ``memory_analysis()`` (arguments, outputs, aliasing, temporaries), the HLO's
collectives and matmul FLOPs (``hlo_stats``), and optionally a measured step time on the devices.

Used by ``python -m dflash_jax.mesh_experiment`` (many layouts) and ``python -m dflash_jax.train
--plan`` / the pre-flight check before a run loads its target (one layout).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.dtypes import to_dtype
from dflash_jax.sharding import (
    BATCH_AXES,
    MESH_AXES,
    LayoutError,
    MeshConfig,
    layout_text,
    logical_sharding,
    make_mesh,
    named_sharding,
    sharded_dims,
)
from dflash_jax.sharding import check_layout as sharding_check_layout
from dflash_jax.tools import hlo_stats
from dflash_jax.training.step import array_shardings, jit_train_step


@dataclass(frozen=True)
class PlanSpec:
    """What one training step looks like, independent of the layout."""

    target_config: object  # TargetConfig
    drafter_config: object  # DrafterConfig
    train_section: object  # run_config.TrainSection: the step's settings and the optimizer's
    target_dtype: str = "bfloat16"
    target_attention_impl: str = "auto"  # target.attention_impl
    batch_rows: int = 8  # R: global packed rows per step
    seq_len: int = 4096  # T
    # ``data.features``: the step reads the target's outputs from the batch (the offline feature
    # cache) instead of running the target, so the batch is larger and there is no forward pass.
    cached_features: bool = False


@dataclass
class LayoutPlan:
    layout: str
    devices: int
    target_param_bytes: int
    drafter_param_bytes: int
    optimizer_bytes: int
    train_argument_bytes: int
    train_output_bytes: int
    train_alias_bytes: int
    train_temp_bytes: int
    target_temp_bytes: int
    flops: float  # matmul FLOPs per device per step (loops multiplied out)
    collectives: dict = field(default_factory=dict)  # kind -> (count, bytes) per device per step
    unknown_trip_loops: int = 0
    collective_shapes: tuple = ()  # (kind, result array type) of each distinct collective (hlo_stats)
    compile_seconds: float = 0.0
    cached_features: bool = False  # planned for a run from the offline feature cache
    step_seconds: float | None = None
    tokens_per_second: float | None = None

    @property
    def peak_bytes(self) -> int:
        """Per-device peak of the train step: live arguments + outputs not aliased + temporaries."""
        return (
            self.train_argument_bytes
            + self.train_output_bytes
            - self.train_alias_bytes
            + self.train_temp_bytes
        )

    @property
    def collective_bytes(self) -> int:
        return sum(b for _, b in self.collectives.values())

    def collectives_summary(self) -> str:
        return hlo_stats.HloStats(
            self.flops, self.collectives, self.unknown_trip_loops, self.collective_shapes
        ).collectives_summary()


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------


def parse_layout(text: str) -> MeshConfig:
    """'data=2,tensor=4' -> MeshConfig(data=2, fsdp=1, tensor=4); unnamed axes are 1."""
    return MeshConfig.from_string(text)


def layout_name(config: MeshConfig, num_devices: int) -> str:
    sizes = config.resolve(num_devices)
    parts = [f"{a}={s}" for a, s in zip(MESH_AXES, sizes, strict=True) if s > 1]
    return ",".join(parts) or "data=1"


def check_layout(config: MeshConfig, spec: PlanSpec, available_devices: int) -> tuple[int, int, int]:
    """``sharding.check_layout`` for a layout of a plan, which names its own devices: the product of
    its sizes (all available ones with a -1 axis), checked against the model's sharded dimensions.

    Returns the (data, fsdp, tensor) sizes. Raises LayoutError naming the dimension and the axis.
    """
    sizes = [config.data, config.fsdp, config.tensor]
    known = math.prod(s for s in sizes if s > 0)
    wanted = config.num_devices or (known if -1 not in sizes else available_devices)
    if known > available_devices or wanted > available_devices:
        raise LayoutError(
            f"layout {layout_text(config)} needs {max(known, wanted)} devices but only "
            f"{available_devices} exist"
        )
    return sharding_check_layout(
        dataclasses.replace(config, num_devices=wanted),
        available_devices,
        batch_rows=spec.batch_rows,
        dims=sharded_dims(spec.target_config, spec.drafter_config),
    )


# --------------------------------------------------------------------------------------------
# abstract state
# --------------------------------------------------------------------------------------------


def _abstract_with_shardings(state, mesh: Mesh):
    """Every leaf of an nnx State -> ShapeDtypeStruct with the sharding of its logical axes."""

    def leaf(var):
        value = var.get_value() if hasattr(var, "get_value") else var
        axes = var.get_metadata().get("logical_axes") if hasattr(var, "get_metadata") else None
        sharding = named_sharding(mesh, axes if value.shape else None, value.shape)
        var = var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        return var

    return jax.tree.map(leaf, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def per_device_bytes(abstract_state) -> int:
    """Bytes one device holds: each leaf's shard shape times its itemsize (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(abstract_state):
        shard = x.sharding.shard_shape(x.shape) if x.shape else ()
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def abstract_target(spec: PlanSpec, mesh: Mesh):
    from dflash_jax.target.hybrid import build_target_model  # dense or hybrid, by model_type

    model = nnx.eval_shape(
        lambda: build_target_model(
            spec.target_config,
            dtype=jnp.dtype(spec.target_dtype),
            rngs=nnx.Rngs(0),
            attention_impl=spec.target_attention_impl,
        )
    )
    graphdef, state = nnx.split(model)
    return graphdef, _abstract_with_shardings(state, mesh)


def abstract_drafter_and_optimizer(spec: PlanSpec, mesh: Mesh):
    from dflash_jax.drafter.model import DFlashDrafter
    from dflash_jax.training.step import make_optimizer

    def create():
        drafter = DFlashDrafter(spec.drafter_config, rngs=nnx.Rngs(0))
        return drafter, nnx.Optimizer(drafter, make_optimizer(spec.train_section), wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(create))
    return graphdef, _abstract_with_shardings(state, mesh)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The trainer's batch layout (``BATCH_AXES`` by the logical rules: rows over the data axes)."""
    return logical_sharding(mesh, BATCH_AXES)


def abstract_batch(spec: PlanSpec, mesh: Mesh) -> dict:
    """The step's input batch; with ``cached_features`` also the arrays the feature cache carries
    (training/feature_cache.py), in the dtype the target computes them in."""
    rows, seq, sharding = spec.batch_rows, spec.seq_len, batch_sharding(mesh)
    s = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=sharding)
    batch = {"input_ids": s, "positions": s, "segment_ids": s, "loss_mask": s}
    if spec.cached_features:
        dtype, hidden = to_dtype(spec.target_dtype), spec.target_config.hidden_size
        taps = len(spec.drafter_config.target_layer_ids)
        batch["features"] = jax.ShapeDtypeStruct((rows, seq, taps * hidden), dtype, sharding=sharding)
        batch["labels"] = s
        if spec.train_section.loss == "kl":
            batch["hidden"] = jax.ShapeDtypeStruct((rows, seq, hidden), dtype, sharding=sharding)
    return batch


def abstract_key(mesh: Mesh):
    """The step's PRNG key as the training loop makes it under ``jax.set_mesh``: replicated."""
    key = jax.eval_shape(lambda: jax.random.key(0))
    return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))


# --------------------------------------------------------------------------------------------
# compiled step functions
# --------------------------------------------------------------------------------------------


def _target_forward_fn(t_graph, layer_ids):
    from dflash_jax.training.step import target_pass

    def forward(t_state, batch):
        return target_pass(nnx.merge(t_graph, t_state), batch, layer_ids)

    return forward


def _cpu_compiler_options(plan_only: bool, *, hoist_invariants: bool = True) -> dict:
    """CPU compiles stand in for GPU ones, with adjustments.

    Memory analysis comes from buffer assignment, before code generation, so a plan-only compile
    skips the expensive LLVM passes (same numbers, ~1/3 less compile time).

    The CPU backend runs bf16 matmuls in f32, and loop-invariant code motion then hoists an f32
    copy of every stacked bf16 weight out of the layer loop (a [L, ...] convert: ~2x the target's
    weights in temporaries, which no GPU compile has). ``hoist_invariants=False`` disables that
    pass: used for the target forward, whose temporaries it would otherwise dominate. The train
    step keeps it, because without it loop-invariant collectives stay inside loops and the
    collective counts stop resembling a GPU compile's (its temporaries carry the distortion:
    ~3 GiB per device for Qwen3-8B with replicated weights, see docs/mesh.md).
    """
    opts = {}
    if not hoist_invariants:
        opts["xla_disable_hlo_passes"] = "while-loop-invariant-code-motion"
    if plan_only:
        opts.update(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)
    return opts


def _cpu(devices) -> bool:
    return all(d.platform == "cpu" for d in devices)


def _memory(compiled):
    m = compiled.memory_analysis()
    if m is None:  # some backends do not report
        return 0, 0, 0, 0
    return (
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        int(m.temp_size_in_bytes),
    )


def lower_train_step(spec: PlanSpec, d_graph, d_state, t_graph, t_state, batch, key):
    """The trainer's step (``training.step.jit_train_step``, state donated, its layout kept) lowered on
    abstract states; the learning rate is a traced scalar, as in the trainer."""
    step = jit_train_step(
        d_graph,
        t_graph,
        spec.train_section,
        state_shardings=array_shardings(d_state),
        # The run holds the whole target even when a cached step reads only its embedding and
        # lm_head: count every weight as a live argument.
        keep_unused=True,
    )
    return step.lower(d_state, t_state, batch, key, jax.ShapeDtypeStruct((), jnp.float32))


@dataclass
class CompiledLayout:
    """One layout's compiled train step and what measuring it needs (abstract states, mesh)."""

    plan: LayoutPlan
    spec: PlanSpec
    mesh: Mesh
    compiled: object
    target_state: object
    drafter_state: object


def compile_layout(
    spec: PlanSpec, layout: MeshConfig, devices=None, *, for_measure: bool = False
) -> CompiledLayout:
    """AOT-compile the target forward and the full train step for one layout; nothing allocated.
    ``for_measure``: compile the step to run it (on CPU, fully optimised) rather than only to plan."""
    devices = list(devices) if devices is not None else jax.devices()
    data, fsdp, tensor = check_layout(layout, spec, len(devices))
    n = data * fsdp * tensor
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices[:n])
    name = layout_name(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), n)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        t_graph, t_state = abstract_target(spec, mesh)
        d_graph, d_state = abstract_drafter_and_optimizer(spec, mesh)
        batch = abstract_batch(spec, mesh)
        key = abstract_key(mesh)

        cpu = _cpu(devices)
        opts = _cpu_compiler_options(plan_only=not for_measure) if cpu else None
        fwd_opts = _cpu_compiler_options(plan_only=True, hoist_invariants=False) if cpu else None
        layer_ids = tuple(spec.drafter_config.target_layer_ids)
        fwd = None  # a run from the feature cache never runs the target forward
        if not spec.cached_features:
            fwd = jax.jit(_target_forward_fn(t_graph, layer_ids)).lower(t_state, batch)
            fwd = fwd.compile(compiler_options=fwd_opts)
        lowered = lower_train_step(spec, d_graph, d_state, t_graph, t_state, batch, key)
        compiled = lowered.compile(compiler_options=opts)
    compile_s = time.perf_counter() - t0
    stats = hlo_stats.analyze(compiled.as_text())
    args, outs, alias, temp = _memory(compiled)
    param_bytes = per_device_bytes(_params_only(d_state))
    plan = LayoutPlan(
        layout=name,
        devices=n,
        target_param_bytes=per_device_bytes(t_state),
        drafter_param_bytes=param_bytes,
        optimizer_bytes=per_device_bytes(d_state) - param_bytes,
        train_argument_bytes=args,
        train_output_bytes=outs,
        train_alias_bytes=alias,
        train_temp_bytes=temp,
        target_temp_bytes=_memory(fwd)[3] if fwd is not None else 0,
        flops=stats.matmul_flops,
        collectives=stats.collectives,
        unknown_trip_loops=stats.unknown_trip_loops,
        collective_shapes=stats.collective_shapes,
        compile_seconds=compile_s,
        cached_features=spec.cached_features,
    )
    return CompiledLayout(plan, spec, mesh, compiled, t_state, d_state)


def measure_layout(c: CompiledLayout, steps: int) -> LayoutPlan:
    """Run a compiled layout ``steps`` times on random weights; its plan gains the median step time."""
    c.plan.step_seconds = _measure(c.compiled, c.spec, c.mesh, c.target_state, c.drafter_state, steps)
    c.plan.tokens_per_second = c.spec.batch_rows * c.spec.seq_len / c.plan.step_seconds
    return c.plan


def plan_layout(
    spec: PlanSpec,
    layout: MeshConfig,
    devices=None,
    *,
    measure_steps: int = 0,
) -> LayoutPlan:
    """AOT-compile the target forward and the full train step for one layout; optionally time it."""
    c = compile_layout(spec, layout, devices, for_measure=measure_steps > 0)
    return measure_layout(c, measure_steps) if measure_steps > 0 else c.plan


def _params_only(state):
    """The drafter's nnx.Param leaves of a (drafter, optimizer) state (index 0 is the drafter)."""
    return state[0]


def _random_like(abstract, seed: int):
    """Concrete arrays with the abstract tree's shapes, dtypes and shardings, made on device."""
    leaves, treedef = jax.tree.flatten(abstract)

    def make(keys):
        out = []
        for k, x in zip(keys, leaves, strict=True):
            if jnp.issubdtype(x.dtype, jnp.floating):
                out.append((0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype))
            else:
                out.append(jnp.zeros(x.shape, x.dtype))
        return out

    keys = list(jax.random.split(jax.random.key(seed), len(leaves)))
    made = jax.jit(make, out_shardings=[x.sharding for x in leaves])(keys)
    return jax.tree.unflatten(treedef, made)


def _measure(compiled, spec: PlanSpec, mesh: Mesh, t_state, d_state, steps: int) -> float:
    """Median seconds per train step on the mesh's devices, random weights, packed random rows."""
    t_real = _random_like(t_state, 0)
    d_real = _random_like(d_state, 1)
    R, T = spec.batch_rows, spec.seq_len
    rng = np.random.default_rng(0)
    doc = max(T // 4, 1)
    seg = (np.arange(T) // doc + 1)[None].repeat(R, 0).astype(np.int32)
    pos = (np.arange(T) % doc)[None].repeat(R, 0).astype(np.int32)
    batch = {
        "input_ids": rng.integers(0, spec.target_config.vocab_size, (R, T)).astype(np.int32),
        "positions": pos,
        "segment_ids": seg,
        "loss_mask": (pos >= doc // 4).astype(np.int32),
    }
    for name, abstract in abstract_batch(spec, mesh).items():  # the feature cache's arrays
        if name == "labels":
            batch[name] = rng.integers(0, spec.target_config.vocab_size, (R, T)).astype(np.int32)
        elif name not in batch:
            batch[name] = rng.standard_normal(abstract.shape, np.float32).astype(abstract.dtype)
    batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    learning_rate = jnp.float32(spec.train_section.learning_rate)
    times = []
    with jax.set_mesh(mesh):
        for i in range(steps + 1):
            t0 = time.perf_counter()
            d_real, metrics = compiled(d_real, t_real, batch, jax.random.key(i), learning_rate)
            jax.block_until_ready(metrics)
            if i:  # the first call carries one-off transfer and allocation costs
                times.append(time.perf_counter() - t0)
    return float(np.median(times))


# --------------------------------------------------------------------------------------------
# from a run config
# --------------------------------------------------------------------------------------------


def spec_for_run(
    cfg,
    *,
    parts=None,
    target_config=None,
    seq_len: int | None = None,
    batch_rows: int | None = None,
    max_anchors=None,
    **train_overrides,
):
    """A PlanSpec of a run (plus sweep overrides), with no weights: of ``parts``, the run's parts as
    ``training.assembly.assemble`` resolved them (the pre-flight check of a run plans the run it
    checks), else of the parts resolved here abstractly (no tokenizer; for ``target_config`` instead
    of the run's own target in a sweep over sizes)."""
    if parts is None:
        from dflash_jax.training.assembly import assemble

        parts = assemble(cfg, abstract=True, target_config=target_config)
    train = cfg.train
    if max_anchors is not None or train_overrides:
        train = dataclasses.replace(
            train, **({"max_anchors": max_anchors} if max_anchors else {}), **train_overrides
        )
    return PlanSpec(
        target_config=parts.target_config,
        drafter_config=parts.drafter_config,
        train_section=train,
        target_dtype=cfg.target.dtype,
        target_attention_impl=cfg.target.attention_impl,
        batch_rows=batch_rows or parts.data.batch_size,
        seq_len=seq_len or parts.data.max_length,
        cached_features=bool(parts.data.features),
    )


def parse_bytes(text: str) -> int:
    """'80GB' / '80GiB' / '80e9' -> bytes (GB = 1e9, GiB = 2**30)."""
    s = str(text).strip().upper().replace(" ", "")
    units = {
        "TIB": 2**40,
        "GIB": 2**30,
        "MIB": 2**20,
        "KIB": 2**10,
        "TB": 10**12,
        "GB": 10**9,
        "MB": 10**6,
        "KB": 10**3,
        "B": 1,
    }
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(float(s))


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class PlanDoesNotFit(RuntimeError):
    """The run's own layout needs more memory per device than its devices have."""


# --------------------------------------------------------------------------------------------
# device memory: jax's pool and the card
# --------------------------------------------------------------------------------------------

# On a GPU jax preallocates this fraction of the card as its memory pool unless
# XLA_CLIENT_MEM_FRACTION (formerly XLA_PYTHON_CLIENT_MEM_FRACTION) says otherwise.
DEFAULT_POOL_FRACTION = 0.75
# Judgement, not measurement: a step planned at the pool's edge can still fail on fragmentation,
# so the advised pool holds the peak plus this margin; and the card keeps memory outside the pool
# (the CUDA context, loaded kernels, communication buffers), so no pool above this is advised.
POOL_HEADROOM = 0.05  # of the step's peak, and at least POOL_HEADROOM_MIN
POOL_HEADROOM_MIN = 2**30
MAX_POOL_FRACTION = 0.97
FRACTION_VARIABLE = "XLA_CLIENT_MEM_FRACTION"
DEPRECATED_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def memory_fraction_variable(env=None) -> str:
    """The variable to advise: the deprecated name where the user already sets it (jax refuses
    both at once), else the current one."""
    env = os.environ if env is None else env
    if env.get(DEPRECATED_FRACTION_VARIABLE) and not env.get(FRACTION_VARIABLE):
        return DEPRECATED_FRACTION_VARIABLE
    return FRACTION_VARIABLE


@dataclass(frozen=True)
class MemoryCheck:
    """A step's per-device peak against jax's pool (``bytes_limit``, what XLA may allocate) and the
    card's memory. The peak is compared with the pool where it is known, else with the card; when
    it exceeds the pool but a larger pool on the same card would hold it, ``advice`` names the
    variable and value to set."""

    peak: int
    pool: int | None  # None: not reported (CPU devices, the platform allocator)
    card: int | None  # None: unknown (CPU without --device-memory)
    variable: str = FRACTION_VARIABLE

    @property
    def limit(self) -> int | None:
        return self.pool if self.pool is not None else self.card

    @property
    def fits(self) -> bool | None:
        """None when no limit is known: nothing is refused."""
        return None if self.limit is None else self.peak <= self.limit

    @property
    def headroom(self) -> int:
        return max(math.ceil(POOL_HEADROOM * self.peak), POOL_HEADROOM_MIN)

    @property
    def fraction(self) -> float | None:
        """The pool, as a fraction of the card rounded up to 0.01, that holds the peak with headroom."""
        if not self.card:
            return None
        return math.ceil(100 * (self.peak + self.headroom) / self.card - 1e-9) / 100

    @property
    def status(self) -> str:
        """'unknown', 'fits', 'needs a larger pool' (the card would hold it) or 'does not fit'."""
        if self.fits is None:
            return "unknown"
        if self.fits:
            return "fits"
        if self.pool is not None and self.fraction is not None and self.fraction <= MAX_POOL_FRACTION:
            return "needs a larger pool"
        return "does not fit"

    def setting(self) -> str:
        return f"{self.variable}={self.fraction:.2f}"

    def limits_text(self) -> str:
        if self.pool is not None:
            share = (
                f", {self.pool / self.card:.0%} of the card's {human_bytes(self.card)}" if self.card else ""
            )
            return f"(jax's pool {human_bytes(self.pool)}{share})"
        if self.card is not None:
            return f"(device memory {human_bytes(self.card)})"
        return "(device memory unknown)"

    def advice(self) -> str | None:
        """What to set or change, or None when nothing needs saying."""
        need = f"the step needs {human_bytes(self.peak)} + {human_bytes(self.headroom)} headroom"
        status = self.status
        if status == "needs a larger pool":
            return (
                f"the card would hold it with a larger pool: set {self.setting()} before jax starts, "
                f"e.g. `{self.setting()} python -m dflash_jax.train ...` ({need}; BUILD.md, GPU memory)"
            )
        if status == "does not fit":
            if self.pool is not None and self.card is None:
                return (
                    f"if the card has more memory than the pool, raise the pool with {self.variable} "
                    "(BUILD.md, GPU memory); else change the layout, train.micro_batches or train.remat"
                )
            if self.pool is not None:
                return (
                    f"even a pool of {MAX_POOL_FRACTION:.0%} of the card is too small ({need}): "
                    "change the layout, train.micro_batches or train.remat"
                )
            return None
        if status == "fits" and self.pool is None and self.card is not None:
            # Planned for a card (--device-memory): say what its pool must be on a GPU.
            if self.fraction > MAX_POOL_FRACTION:
                return (
                    f"on a GPU of {human_bytes(self.card)} no pool jax can be given holds it with "
                    f"headroom ({need}): it may run out of memory at run time"
                )
            if self.fraction > DEFAULT_POOL_FRACTION:
                return (
                    f"on a GPU of {human_bytes(self.card)} jax's default pool "
                    f"({DEFAULT_POOL_FRACTION:.0%}) is too small: run it with {self.setting()} ({need})"
                )
        return None


def check_memory(peak: int, *, pool: int | None, card: int | None, env=None) -> MemoryCheck:
    """The pure decision of the pre-flight and of ``mesh_experiment``'s ``fits`` (numbers injected)."""
    return MemoryCheck(int(peak), pool, card, memory_fraction_variable(env))


def _local(devices) -> list:
    """The devices this process can query (a multi-host mesh lists every host's)."""
    mine = [d for d in devices if d.process_index == jax.process_index()]
    return mine or list(devices)


def device_memory_limit(devices) -> int | None:
    """jax's pool on one device: the bytes XLA may allocate (``memory_stats()["bytes_limit"]``),
    the smallest over this process's devices; None where devices do not report it (CPU)."""
    limits = []
    for d in _local(devices):
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory stats
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def _cuda_total_memory(ordinal: int) -> int | None:
    """The card's memory from the CUDA driver (``cuDeviceTotalMem``), which numbers devices as jax's
    ``local_hardware_id`` does (both after CUDA_VISIBLE_DEVICES)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, total = ctypes.c_int(), ctypes.c_size_t()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return None
    if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev) != 0:
        return None
    return int(total.value)


def physical_memory(devices) -> int | None:
    """The card's memory per device (the smallest over this process's devices) on NVIDIA GPUs;
    None elsewhere or when the driver cannot be asked."""
    totals = []
    for d in _local(devices):
        if d.platform != "gpu":  # an AMD GPU has no libcuda either: the card stays unknown
            return None
        try:
            total = _cuda_total_memory(int(d.local_hardware_id))
        except Exception:  # noqa: BLE001 - an unusual driver: the card stays unknown
            return None
        if total is None:
            return None
        totals.append(total)
    return min(totals) if totals else None


def read_device_memory(devices, card: int | None = None) -> tuple[int | None, int | None]:
    """(pool, card) of the devices; ``card`` (``--device-memory``) replaces the driver's figure."""
    return device_memory_limit(devices), card if card is not None else physical_memory(devices)


def describe(plan: LayoutPlan, memory: MemoryCheck | None = None) -> str:
    advice = memory.advice() if memory is not None else None
    lines = [
        f"plan for layout {plan.layout} on {plan.devices} devices (per device):",
        f"  target params   {human_bytes(plan.target_param_bytes)}",
        f"  drafter params  {human_bytes(plan.drafter_param_bytes)}",
        f"  optimizer       {human_bytes(plan.optimizer_bytes)}",
        f"  step temporaries {human_bytes(plan.train_temp_bytes)}",
        f"  step peak       {human_bytes(plan.peak_bytes)}  "
        + (memory.limits_text() if memory is not None else "(device memory unknown)"),
        f"  target forward temporaries {human_bytes(plan.target_temp_bytes)}"
        + ("  (none: features from the cache)" if plan.cached_features else ""),
        f"  matmul TFLOP/step {plan.flops / 1e12:.2f}; collectives: {plan.collectives_summary()}",
    ]
    if advice and memory.fits:
        lines.append(f"  note: {advice}")
    return "\n".join(lines)


def preflight(cfg, devices, *, parts=None, device_memory: int | None = None) -> tuple[LayoutPlan, str]:
    """Plan the run's own config and mesh before any weight is read (of ``parts``, the run's
    resolved parts, else of the config's abstract parts); raise PlanDoesNotFit (with the numbers,
    and the pool setting that would fit it where the card could hold it) when the step's per-device
    peak exceeds jax's pool (``bytes_limit``), or, where the devices report none (CPU), the card's
    memory ``device_memory``. With neither known nothing is refused."""
    spec = spec_for_run(cfg, parts=parts)
    p = plan_layout(spec, cfg.mesh, devices)
    pool, card = read_device_memory(devices, device_memory)
    memory = check_memory(p.peak_bytes, pool=pool, card=card)
    text = describe(p, memory)
    if memory.fits is False:
        what = "jax's pool" if memory.pool is not None else "the devices"
        advice = memory.advice() or (
            "try python -m dflash_jax.mesh_experiment --config ... --layouts ... "
            "(other layouts, train.micro_batches, train.remat) before loading the target"
        )
        raise PlanDoesNotFit(
            f"{text}\nthe train step needs {human_bytes(p.peak_bytes)} per device but {what} "
            f"has {human_bytes(memory.limit)}: {advice}"
        )
    return p, text


# --------------------------------------------------------------------------------------------
# the feature cache on disk
# --------------------------------------------------------------------------------------------


def cache_row_bytes(cfg, parts=None) -> dict[str, int]:
    """The bytes a row of this run's feature cache stores, per array (``feature_cache.row_bytes``
    of its target, taps, ``data.max_length`` and loss, in ``target.dtype``, what ``data.features:
    auto`` stores); of ``parts`` as in :func:`spec_for_run`, reading no weight and no data."""
    from dflash_jax.training.feature_cache import row_bytes

    if parts is None:
        from dflash_jax.training.assembly import assemble

        parts = assemble(cfg, abstract=True)
    return row_bytes(
        seq_len=parts.data.max_length,
        hidden_size=parts.target_config.hidden_size,
        num_taps=len(parts.drafter_config.target_layer_ids),
        dtype=cfg.target.dtype,
        loss=cfg.train.loss,
    )


def training_records(cfg) -> tuple[int, str]:
    """(an upper bound on the documents of one epoch, where it comes from): the training records
    of ``data.sources`` (indexed: no tokenizer), at most ``regen.num_prompts`` when the run trains
    on regenerated replies."""
    from dflash_jax.data.pipeline import split_records

    _, _, report = split_records(cfg.data)
    records = report.train_records
    if cfg.regen.enabled and cfg.regen.num_prompts < records:
        return cfg.regen.num_prompts, f"regen.num_prompts={cfg.regen.num_prompts}"
    return records, f"the {records:,} training records of data.sources"


def describe_feature_cache(cfg, parts=None, *, records: tuple[int, str] | None = None) -> str:
    """What ``train --plan`` prints about the feature cache: the bytes a row stores, the total for
    the epoch's rows (a bound of one document a row: the build counts them before writing) and
    whether the free space of the cache's filesystem holds it now. ``records``: (count, origin)
    instead of indexing the data (:func:`training_records`)."""
    from dflash_jax import assets
    from dflash_jax.data.shards import resolve_num_shards
    from dflash_jax.training.feature_cache import (
        MANIFEST,
        CacheSize,
        FeatureCache,
        bound_rows,
        free_bytes,
        human_size,
        size_advice,
    )

    features = cfg.data.features
    if features and features != "auto" and (Path(features).expanduser() / MANIFEST).is_file():
        cache = FeatureCache(features)
        total = sum(e["bytes"] for sh in cache.shards for e in sh["files"].values())
        return (
            f"feature cache {cache.path}: built, {cache.rows:,} rows, {human_size(total)} (nothing to write)"
        )
    if features and features != "auto":
        where = Path(features).expanduser().absolute()
    else:
        where = assets.cache_root().absolute() / "features"
    use = {
        None: "this run trains online; data.features: auto or python -m dflash_jax.features builds it",
        "auto": "data.features: auto, under $" + assets.CACHE_ENV,
    }.get(features, "data.features")
    if parts is None:
        from dflash_jax.training.assembly import assemble

        parts = assemble(cfg, abstract=True)
    per_row = cache_row_bytes(cfg, parts)
    T, dtype = cfg.data.max_length, cfg.target.dtype
    taps, hidden = len(parts.drafter_config.target_layer_ids), parts.target_config.hidden_size
    small = sum(b for name, b in per_row.items() if name not in ("features", "hidden"))
    arrays = [f"features {human_size(per_row['features'])} ({taps} taps x hidden {hidden})"]
    if "hidden" in per_row:
        arrays.append(f"train.loss kl's hidden state {human_size(per_row['hidden'])}")
    arrays.append(f"int32 row arrays and labels {human_size(small)}")
    lines = [
        f"feature cache ({use}): {where}",
        f"  a row: {human_size(sum(per_row.values()))} at T={T} in {dtype}: {', '.join(arrays)}",
    ]
    directory, free = free_bytes(where)
    try:
        count, origin = records if records is not None else training_records(cfg)
    except Exception as e:  # noqa: BLE001 - data not readable here: the per-row figure stands
        lines.append(f"  rows: unknown here ({e}); {human_size(free)} free on {directory}")
        return "\n".join(lines)
    rows = bound_rows(count, cfg.data.batch_size, resolve_num_shards(cfg.data.shards, 1))
    size = CacheSize(directory, rows, per_row, free)
    lines += [
        f"  rows: at most {rows:,}, one per document ({origin}); packing puts short documents "
        "together, and the build counts the rows before it writes",
        f"  one epoch: {size.summary()}",
    ]
    if size.fits:
        lines.append("  fits the free space now")
    else:
        lines.append(
            "  the bound does not fit the free space now (the build refuses before writing if the "
            f"counted rows do not): {size_advice(size, seq_len=T, loss=cfg.train.loss, dtype=dtype)}"
        )
    return "\n".join(lines)


def check_run_fits(cfg, parts, mesh, device_memory: int | None = None, *, quiet=False):
    """Pre-flight: AOT-compile this run's step (of its resolved ``parts``) on abstract weights and
    refuse a run that cannot fit, before the target is loaded (``preflight``). Runs when the devices
    report their pool or card (GPUs) or when ``device_memory`` is given; CPU runs without it skip
    the compile."""
    devices = list(mesh.devices.flat)
    if device_memory is None and device_memory_limit(devices) is None and physical_memory(devices) is None:
        return None
    p, text = preflight(cfg, devices, parts=parts, device_memory=device_memory)
    if not quiet:
        logging.getLogger("dflash_jax.train").info("pre-flight memory plan:\n%s", text)
    return p
