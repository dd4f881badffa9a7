"""Joining a multi-process run (``jax.distributed``) and the few collectives the trainer needs.

Every host runs the same command. Whether (and how) a process joins a multi-process run comes,
in this order, from

1. flags: ``--coordinator HOST:PORT --num-processes N --process-id I`` (see :func:`add_arguments`);
2. environment: ``JAX_COORDINATOR_ADDRESS`` (read by jax itself) with ``JAX_NUM_PROCESSES`` and
   ``JAX_PROCESS_ID`` (set by ``python -m dflash_jax.launch``, a Kubernetes Indexed Job, ...);
3. a SLURM step with more than one task (``SLURM_NTASKS`` > 1): jax detects coordinator and ids;

and otherwise the process runs alone. :func:`initialize` must run before any jax computation.
On CPU the cross-process collectives go through gloo, so the whole multi-process path runs on
one machine with N processes (``JAX_NUM_CPU_DEVICES`` devices each).

Liveness: each process sends heartbeats to the coordinator; one that stops (crashed, killed,
frozen) is declared dead after ``heartbeat_timeout_s`` and every other process then aborts with
an error naming the dead task ids. A process that is alive but never reaches the next
collective is not detected by jax: bound the whole run with the launcher's ``--timeout`` or the
scheduler's time limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "DFLASH_HEARTBEAT_TIMEOUT_S"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run.

    coordinator:        HOST:PORT of process 0's coordinator service (None: detect, e.g. SLURM)
    num_processes:      processes in the run (None: detect)
    process_id:         this process, in [0, num_processes) (None: detect)
    heartbeat_timeout_s: a peer silent this long is declared dead and the run aborts naming it
    init_timeout_s:     how long to wait for all processes to connect
    shutdown_timeout_s: how long a finished process waits at exit for the others
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = 100
    init_timeout_s: int = 300
    shutdown_timeout_s: int = 300

    def __post_init__(self):
        if self.coordinator is not None:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None:
            if self.process_id < 0 or (
                self.num_processes is not None and self.process_id >= self.num_processes
            ):
                raise ValueError(
                    f"process_id must be in [0, num_processes={self.num_processes}), got {self.process_id}"
                )
        for name in ("heartbeat_timeout_s", "init_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 second, got {getattr(self, name)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-process flags shared by every entry point."""
    g = parser.add_argument_group(
        "multi-process (jax.distributed)",
        f"or set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}; under SLURM they are detected",
    )
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's coordinator address")
    g.add_argument("--num-processes", type=int, default=None, metavar="N")
    g.add_argument("--process-id", type=int, default=None, metavar="I")
    g.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help=f"seconds before a silent peer is declared dead (default 100; env {ENV_HEARTBEAT_TIMEOUT})",
    )


def config_from(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None):
    """-> DistributedConfig when this process should join a multi-process run, else None."""
    env = os.environ if environ is None else environ
    get = (lambda name: getattr(args, name, None)) if args is not None else (lambda name: None)

    def env_int(name):
        v = env.get(name)
        if v in (None, ""):
            return None
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"environment variable {name} must be an integer, got {v!r}") from None

    coordinator = get("coordinator") or env.get(ENV_COORDINATOR) or None
    num = get("num_processes") if get("num_processes") is not None else env_int(ENV_NUM_PROCESSES)
    pid = get("process_id") if get("process_id") is not None else env_int(ENV_PROCESS_ID)
    heartbeat = get("heartbeat_timeout") or env_int(ENV_HEARTBEAT_TIMEOUT) or 100
    slurm_tasks = env_int("SLURM_NTASKS") or 1
    if coordinator is None and num is None and pid is None:
        if slurm_tasks > 1:  # jax's SLURM detection fills in all three
            return DistributedConfig(heartbeat_timeout_s=heartbeat)
        return None
    if num == 1 and coordinator is None:
        return None
    missing = [
        n
        for n, v in (("--coordinator", coordinator), ("--num-processes", num), ("--process-id", pid))
        if v is None
    ]
    if missing and slurm_tasks <= 1:
        raise ValueError(
            f"multi-process run: {', '.join(missing)} not given (flags, or env {ENV_COORDINATOR}, "
            f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})"
        )
    return DistributedConfig(
        coordinator=coordinator, num_processes=num, process_id=pid, heartbeat_timeout_s=heartbeat
    )


def initialize(config: DistributedConfig | None) -> None:
    """Join the run described by ``config`` (None: stay single-process). Idempotent."""
    import jax

    if config is None or jax.distributed.is_initialized():
        return
    # CPU collectives across processes need gloo; it does not affect GPU/TPU backends.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator,
        num_processes=config.num_processes,
        process_id=config.process_id,
        initialization_timeout=config.init_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s,
        shutdown_timeout_seconds=config.shutdown_timeout_s,
    )
    log.info(
        "joined a %d-process run as process %d: %d local / %d global devices (%s)",
        jax.process_count(),
        jax.process_index(),
        jax.local_device_count(),
        jax.device_count(),
        jax.default_backend(),
    )


def initialize_from(args: argparse.Namespace | None = None) -> DistributedConfig | None:
    """:func:`config_from` + :func:`initialize`: the first call of every entry point's main()."""
    cfg = config_from(args)
    initialize(cfg)
    return cfg


def missing_peers() -> list[int] | None:
    """The processes of this run that the coordination service no longer counts as alive (one
    that died drops its connection at once; a stalled one after the heartbeat timeout), or None
    when there is no multi-process run or it cannot be asked (the coordinator, on process 0,
    is gone: then ``[0]`` from the other processes)."""
    import sys

    if "jax" not in sys.modules:
        return None
    import jax

    if not jax.distributed.is_initialized() or jax.process_count() < 2:
        return None
    n, me = jax.process_count(), jax.process_index()
    try:
        from jax._src import distributed as jax_distributed

        live = jax_distributed.global_state.client.get_live_nodes(list(range(n)))
    except Exception:  # noqa: BLE001 - the coordinator itself is unreachable
        return [0] if me != 0 else None
    return sorted(set(range(n)) - {int(k) for k in live})


def failure_note() -> str | None:
    """Who broke a multi-process run, for the one error line: ``process J of N left the run``;
    None when every peer is alive (the failure is this process's own) or running alone."""
    gone = missing_peers()
    if not gone:
        return None
    import jax

    who = ", ".join(map(str, gone))
    return (
        f"process {who} of {jax.process_count()} left the run (died, or stopped sending heartbeats); "
        f"process {jax.process_index()} stopped with it"
    )


def exit_on_error(main):
    """Wrap an entry point's ``main``: in a multi-process run an uncaught error ends this process
    at once with exit code 1 (after printing it), and a non-zero exit code (an expected error,
    already reported on one line) ends it at once with that code, instead of waiting up to the
    shutdown timeout for peers that will never reach the end; the launcher or scheduler then
    stops the rest."""

    def wrapped(*args, **kwargs):
        try:
            rc = main(*args, **kwargs)
        except BaseException as e:
            import jax

            if not jax.distributed.is_initialized() or isinstance(e, SystemExit) and not e.code:
                raise
            import sys
            import traceback

            note = failure_note()
            if note is None or os.environ.get("DFLASH_TRACEBACK"):  # a peer's death is not our bug
                traceback.print_exc()
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:400]
            print(
                f"error: {note}: {detail}" if note else f"process {jax.process_index()} failed: {detail}",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(1)
        import jax

        if rc and jax.distributed.is_initialized():  # an expected error (one line printed): same early exit
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc

    return wrapped


def process_index() -> int:
    import jax

    return jax.process_index()


def is_primary() -> bool:
    """True on process 0: the one that writes logs, metrics, plots and exports."""
    return process_index() == 0


def configure_logging(level: int = logging.INFO) -> None:
    """INFO logging on process 0; warnings and errors only on the others (prefixed by process)."""
    import jax

    n, i = jax.process_count(), jax.process_index()
    prefix = f"[process {i}/{n}] " if n > 1 else ""
    logging.basicConfig(
        level=level if i == 0 else max(level, logging.WARNING),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
        force=True,
    )


def barrier(name: str) -> None:
    """Wait until every process got here (no-op when running alone)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def allgather_json(obj) -> list:
    """Every process's JSON-serialisable ``obj``, in process order (``[obj]`` when running alone)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(gathered, lengths, strict=True)]
