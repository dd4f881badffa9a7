"""Compare mesh layouts for a training config without loading a weight.

``python -m dflash_jax.mesh_experiment --config qwen3-8b --devices 8 --layouts data=8 fsdp=8
"data=2,tensor=4" --seq-len 4096 --device-memory 80GB --out runs/mesh``

For each layout it AOT-compiles the target forward and the full drafter train step on abstract
parameters (``dflash_jax.tools.plan``) and reports per device: parameter bytes (target, drafter),
optimizer bytes, the train step's temporaries and peak, the target forward's temporaries, matmul
FLOPs, the collectives in the HLO (kind, count, bytes per step), and, with ``--measure N``, the
measured step time and tokens/s on the devices. A markdown table goes to stdout; ``layouts.csv``
(rewritten after every layout) and ``layouts.png`` go to ``--out``. Each layout's peak is checked
as the pre-flight checks a run: against jax's memory pool where the devices report it (GPUs), else
against ``--device-memory`` (the card); a layout over it is flagged, with the
``XLA_CLIENT_MEM_FRACTION`` that would fit it where the card could, and is not measured. Every
layout gets a row with its status (planned, measured, does not fit, impossible, compile failed,
run failed, out of memory) and the reason of a failure: one failing layout does not end the
experiment. The best layout that fits is named: the fastest measured one, else the lowest
estimated step time (FLOPs / ``--peak-tflops`` + collective bytes / ``--link-gbps``; a rough model,
not a measurement).

``--devices N`` on a host without N accelerators simulates N CPU devices (set before jax starts);
``--cpu`` forces that on an accelerator host. CPU compiles give CPU buffer assignments: a plan, not
a GPU measurement. ``--sweep train.micro_batches=1,2`` crosses layouts with config variants.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_jax.cli import UserError, check_output_free, cli

# A row's status: what became of its (variant, layout).
PLANNED = "planned"  # compiled; not measured (no --measure)
MEASURED = "measured"
DOES_NOT_FIT = "does not fit"  # compiled, over the memory: not run
IMPOSSIBLE = "impossible"  # the layout cannot shard this model (LayoutError)
COMPILE_FAILED = "compile failed"
RUN_FAILED = "run failed"
OUT_OF_MEMORY = "out of memory"  # the compile or the measured run ran out of device memory
# Rows that may be named the best layout.
USABLE = (PLANNED, MEASURED)


@dataclass(frozen=True)
class Row:
    variant: str
    layout: str
    plan: object  # plan.LayoutPlan, or None when the layout is impossible or did not compile
    error: str | None = None  # the reason of a failed or refused row (one line)
    estimated_seconds: float | None = None
    fits: bool | None = None
    status: str = PLANNED
    memory: object = None  # plan.MemoryCheck, when the plan compiled


def estimate_seconds(p, peak_tflops: float, link_gbps: float) -> float:
    return p.flops / (peak_tflops * 1e12) + p.collective_bytes / (link_gbps * 1e9)


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _reason(e: BaseException, limit: int = 300) -> str:
    """An exception as one table cell: its type and first line, cut short (XLA's are long)."""
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_experiment(
    cfg,
    layouts: list[str],
    *,
    devices=None,
    seq_len: int | None = None,
    batch_rows: int | None = None,
    anchors: int | None = None,
    device_memory: int | None = None,
    measure_steps: int = 0,
    sweep: dict[str, list] | None = None,
    peak_tflops: float = 989.0,
    link_gbps: float = 450.0,
    progress: bool = True,
    on_row: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Plan every (variant, layout); each becomes a row, whatever befalls it.

    An impossible layout, a compile that raises (out of memory included) or a measured run that
    raises is recorded with its status and reason, and the experiment goes on. The plan's peak is
    checked as the pre-flight checks a run (``plan.check_memory``: jax's pool where the devices
    report it, else ``device_memory``, the card); with ``measure_steps`` only rows that fit are run.
    ``on_row(rows)`` is called after every row (the CLI rewrites its CSV, so a crash keeps the
    rows done)."""
    import gc

    from tqdm import tqdm

    from dflash_jax.config_io import apply_overrides, from_dict
    from dflash_jax.tools import plan
    from dflash_jax.training.run_config import RunConfig

    variants = [("", cfg)]
    if sweep:
        keys = list(sweep)
        variants = []
        for values in itertools.product(*(sweep[k] for k in keys)):
            over = [f"{k}={v}" for k, v in zip(keys, values, strict=True)]
            data = apply_overrides(cfg.to_dict(), over)
            variants.append((" ".join(over), from_dict(RunConfig, data)))
    pool, card = plan.read_device_memory(devices if devices is not None else _jax_devices(), device_memory)

    def one_row(name: str, c, lay: str) -> Row:
        try:
            spec = plan.spec_for_run(c, seq_len=seq_len, batch_rows=batch_rows, max_anchors=anchors)
            compiled = plan.compile_layout(
                spec, plan.parse_layout(lay), devices, for_measure=measure_steps > 0
            )
        except plan.LayoutError as e:
            return Row(name, lay, None, error=str(e), status=IMPOSSIBLE)
        except Exception as e:  # noqa: BLE001 - one layout's failure must not end the experiment
            status = OUT_OF_MEMORY if _out_of_memory(e) else COMPILE_FAILED
            return Row(name, lay, None, error=_reason(e), status=status)
        p = compiled.plan
        memory = plan.check_memory(p.peak_bytes, pool=pool, card=card)
        est = estimate_seconds(p, peak_tflops, link_gbps)
        row = Row(name, p.layout, p, estimated_seconds=est, fits=memory.fits, memory=memory)
        if memory.fits is False:
            return dataclasses.replace(row, status=DOES_NOT_FIT, error=memory.advice())
        if measure_steps <= 0:
            return row
        try:
            plan.measure_layout(compiled, measure_steps)
        except Exception as e:  # noqa: BLE001 - as above; the plan's numbers stay in the row
            status = OUT_OF_MEMORY if _out_of_memory(e) else RUN_FAILED
            return dataclasses.replace(row, status=status, error=_reason(e))
        return dataclasses.replace(row, status=MEASURED)

    rows: list[Row] = []
    jobs = [(name, c, lay) for name, c in variants for lay in layouts]
    for name, c, lay in tqdm(jobs, desc="layouts", unit="layout", disable=not progress):
        rows.append(one_row(name, c, lay))
        gc.collect()  # a failed run's arrays go with its traceback, before the next layout allocates
        if on_row is not None:
            on_row(rows)
    return rows


def _jax_devices():
    import jax

    return jax.devices()


def best_row(rows: list[Row]) -> Row | None:
    ok = [r for r in rows if r.plan is not None and r.status in USABLE and r.fits is not False]
    if not ok:
        return None
    if all(r.plan.step_seconds is not None for r in ok):
        return min(ok, key=lambda r: r.plan.step_seconds)
    return min(ok, key=lambda r: r.estimated_seconds)


def _gib(n) -> str:
    return f"{n / 2**30:.2f}"


def _memory_note(memory) -> str:
    """The pool a row needs, where that is news: over jax's pool but within the card, or planned
    for a card (``--device-memory`` on CPU) above jax's default pool of it."""
    from dflash_jax.tools import plan

    if memory is None or memory.fraction is None:
        return ""
    if memory.status == "needs a larger pool":
        return f"set {memory.setting()}"
    if memory.fits and memory.pool is None:
        if memory.fraction > plan.MAX_POOL_FRACTION:
            return "no headroom on the GPU"
        if memory.fraction > plan.DEFAULT_POOL_FRACTION:
            return f"on the GPU: {memory.setting()}"
    return ""


def status_text(r: Row) -> str:
    """A row's status cell: the status, the reason of a failure, the pool it needs."""
    text = r.status
    if r.error and r.status not in (DOES_NOT_FIT, IMPOSSIBLE):
        text += f": {r.error}"
    note = _memory_note(r.memory)
    return text + (f"; {note}" if note else "")


def markdown_table(rows: list[Row], device_memory: int | None = None) -> str:
    head = [
        "variant", "layout", "dev", "target params GiB", "drafter params GiB", "optimizer GiB",
        "step temp GiB", "step peak GiB", "target fwd temp GiB", "TFLOP/dev", "collectives / step",
        "est. s", "meas. s", "tok/s", "fits", "status",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.plan is None:
            cell = f"{r.status}: {r.error}".replace("|", "/")
            lines.append(f"| {r.variant} | {r.layout} | {cell} |" + " |" * (len(head) - 3))
            continue
        p = r.plan
        fits = "" if r.fits is None else ("yes" if r.fits else "**NO**")
        meas = "" if p.step_seconds is None else f"{p.step_seconds:.3f}"
        tps = "" if p.tokens_per_second is None else f"{p.tokens_per_second:.0f}"
        cells = [
            r.variant, p.layout, str(p.devices), _gib(p.target_param_bytes), _gib(p.drafter_param_bytes),
            _gib(p.optimizer_bytes), _gib(p.train_temp_bytes), _gib(p.peak_bytes), _gib(p.target_temp_bytes),
            f"{p.flops / 1e12:.1f}", p.collectives_summary(), f"{r.estimated_seconds:.3f}", meas, tps, fits,
            status_text(r).replace("|", "/"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(rows: list[Row], path: Path) -> Path:
    fields = [
        "variant", "layout", "devices", "target_param_bytes", "drafter_param_bytes", "optimizer_bytes",
        "train_argument_bytes", "train_output_bytes", "train_alias_bytes", "train_temp_bytes",
        "peak_bytes", "target_temp_bytes", "flops", "collective_bytes", "collectives",
        "unknown_trip_loops", "compile_seconds", "estimated_seconds", "step_seconds",
        "tokens_per_second", "fits", "status", "pool_bytes", "card_bytes", "pool_fraction_needed",
        "error",
    ]  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            rec = {
                "variant": r.variant,
                "layout": r.layout,
                "error": r.error or "",
                "fits": "" if r.fits is None else r.fits,
                "status": r.status,
            }
            if r.memory is not None:
                m = r.memory
                rec.update(
                    pool_bytes="" if m.pool is None else m.pool,
                    card_bytes="" if m.card is None else m.card,
                    pool_fraction_needed="" if m.fraction is None else m.fraction,
                )
            if r.plan is not None:
                p = r.plan
                rec.update({k: getattr(p, k) for k in fields if hasattr(p, k)})
                rec["collectives"] = p.collectives_summary()
                rec["estimated_seconds"] = r.estimated_seconds
            w.writerow(rec)
    return path


def plot(rows: list[Row], path: Path, device_memory: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.plan is not None]
    labels = [(r.variant + " " if r.variant else "") + r.plan.layout for r in ok]
    parts = [
        ("target params", lambda p: p.target_param_bytes),
        ("drafter params", lambda p: p.drafter_param_bytes),
        ("optimizer", lambda p: p.optimizer_bytes),
        ("other step args/outputs", lambda p: p.peak_bytes - p.train_temp_bytes - p.target_param_bytes
         - p.drafter_param_bytes - p.optimizer_bytes),
        ("step temporaries", lambda p: p.train_temp_bytes),
    ]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(ok) + 2), 4.5))
    bottom = [0.0] * len(ok)
    for name, get in parts:
        vals = [max(get(r.plan), 0) / 2**30 for r in ok]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    memory = next((r.memory for r in ok if r.memory is not None and r.memory.limit), None)
    if memory is not None:
        label = "jax's pool" if memory.pool is not None else "device memory"
        ax.axhline(memory.limit / 2**30, color="red", linestyle="--", label=label)
    elif device_memory:
        ax.axhline(device_memory / 2**30, color="red", linestyle="--", label="device memory")
    ax.set_ylabel("GiB per device (train step peak)")
    ax.set_title("Per-device memory by mesh layout")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _parse_sweep(items: list[str]) -> dict[str, list]:
    import yaml

    out = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or not values:
            raise SystemExit(f"--sweep {item!r} must look like section.key=V1,V2")
        out[key] = [yaml.safe_load(v) for v in values.split(",")]
    return out


@cli
def main(argv: list[str] | None = None) -> int:
    """Exit codes as every command (dflash_jax.cli); 3: no layout fits."""
    p = argparse.ArgumentParser(
        prog="python -m dflash_jax.mesh_experiment", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--config", required=True, help="a YAML path or a name in configs/")
    p.add_argument("--layouts", nargs="+", required=True, help='e.g. data=8 fsdp=8 "data=2,tensor=4"')
    p.add_argument("--devices", type=int, default=None, help="devices to plan for (CPU: simulated)")
    p.add_argument("--cpu", action="store_true", help="simulate on CPU devices even on an accelerator host")
    p.add_argument("--seq-len", type=int, default=None, help="T (default: data.max_length)")
    p.add_argument("--batch", type=int, default=None, help="global packed rows R (default: data.batch_size)")
    p.add_argument("--anchors", type=int, default=None, help="anchors per row (default: train.max_anchors)")
    p.add_argument(
        "--device-memory",
        default=None,
        help="the card's memory per device, e.g. 80GB or 80GiB: layouts above it are flagged where the "
        "devices report no pool (CPU), and the pool each one needs is named (default: the GPU driver's)",
    )
    p.add_argument("--measure", type=int, default=0, metavar="STEPS", help="time STEPS real steps per layout")
    p.add_argument("--sweep", nargs="*", default=[], help="config variants, e.g. train.micro_batches=1,2")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="for the estimate (H100 bf16 dense)")
    p.add_argument("--link-gbps", type=float, default=450.0, help="for the estimate (GB/s per device)")
    p.add_argument("--out", default="runs/mesh_experiment", help="directory for layouts.csv and layouts.png")
    p.add_argument(
        "--overwrite", action="store_true", help="replace layouts.csv/layouts.png already in --out"
    )
    p.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = p.parse_intermixed_args(argv)  # key=value overrides may come before or after flags
    out = Path(args.out)
    for name in ("layouts.csv", "layouts.png"):
        check_output_free(out / name, overwrite=args.overwrite)

    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Only the CPU platform reads this; set before jax initialises its backends.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    import jax

    from dflash_jax.sharding import MeshConfig
    from dflash_jax.tools.plan import parse_bytes
    from dflash_jax.training.run_config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    for layout in args.layouts:  # a malformed one is a usage error, not a row of the table
        MeshConfig.from_string(layout)
    devices = jax.devices()
    if args.devices:
        if args.devices > len(devices):
            raise UserError(
                f"--devices {args.devices}: only {len(devices)} {devices[0].platform} devices exist "
                f"(use --cpu to simulate {args.devices} CPU devices)"
            )
        devices = devices[: args.devices]
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    out.mkdir(parents=True, exist_ok=True)
    rows = run_experiment(
        cfg,
        args.layouts,
        devices=devices,
        seq_len=args.seq_len,
        batch_rows=args.batch,
        anchors=args.anchors,
        device_memory=memory,
        measure_steps=args.measure,
        sweep=_parse_sweep(args.sweep),
        peak_tflops=args.peak_tflops,
        link_gbps=args.link_gbps,
        on_row=lambda done: write_csv(done, out / "layouts.csv"),  # a crash keeps the rows done
    )
    spec_line = (
        f"config {args.config}, {len(devices)} {devices[0].platform} devices, "
        f"T={args.seq_len or cfg.data.max_length}, rows={args.batch or cfg.data.batch_size}, "
        f"anchors={args.anchors or cfg.train.max_anchors}"
    )
    print(spec_line)
    print(markdown_table(rows, memory))
    write_csv(rows, out / "layouts.csv")
    if any(r.plan is not None for r in rows):
        plot(rows, out / "layouts.png", memory)
    best = best_row(rows)
    if best is None:
        print("\nno layout fits" + (f" in {args.device_memory} per device" if memory else ""))
        needs = [r for r in rows if r.memory is not None and r.memory.status == "needs a larger pool"]
        if needs:
            best_pool = min(needs, key=lambda r: r.memory.fraction)
            print(f"{best_pool.layout} would fit a larger jax pool: {best_pool.memory.advice()}")
    else:
        how = "measured" if best.plan.step_seconds is not None else "estimated"
        print(
            f"\nbest layout that fits: {best.plan.layout}{' (' + best.variant + ')' if best.variant else ''} "
            f"- peak {best.plan.peak_bytes / 2**30:.2f} GiB/device, {how} "
            f"{best.plan.step_seconds if best.plan.step_seconds is not None else best.estimated_seconds:.3f} s/step"
        )
    if devices[0].platform == "cpu":
        print("(compiled for CPU devices: buffer sizes are a plan for any backend, not a GPU measurement)")
    print(f"outputs: {out / 'layouts.csv'}, {out / 'layouts.png'}")
    return 0 if any(r.plan is not None for r in rows) else 3
