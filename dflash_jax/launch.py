"""Try a multi-host layout on one machine: N local processes of one entry point.

    python -m dflash_jax.launch --local-processes 2 --devices-per-process 4 -- --config tiny

starts ``python -m dflash_jax.train <args>`` N times with the environment that makes each one a
process of one ``jax.distributed`` run (coordinator on a free local port, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``; on CPU ``JAX_NUM_CPU_DEVICES`` devices each, on GPU a slice of the local GPUs).
Their output is interleaved line by line, prefixed ``[pI]``. As soon as one process fails, the
others are stopped and the launcher exits non-zero naming it; ``--timeout`` bounds the whole run.
On a real cluster use the scheduler instead (BUILD.md, "Multi-host").
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from dflash_jax import distributed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(
    base: dict, *, coordinator: str, num: int, index: int, devices: int, platform: str, heartbeat: int
) -> dict:
    env = dict(base)
    env.update(
        {
            distributed.ENV_COORDINATOR: coordinator,
            distributed.ENV_NUM_PROCESSES: str(num),
            distributed.ENV_PROCESS_ID: str(index),
            distributed.ENV_HEARTBEAT_TIMEOUT: str(heartbeat),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
        # An inherited --xla_force_host_platform_device_count (e.g. the test suite's 8) would win.
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip()
    else:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(index * devices + d) for d in range(devices))
    return env


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


# What jax's coordination service prints on the survivors when a peer stops sending heartbeats
# (dead or frozen): it then aborts them (SIGABRT), so the first process to exit is not the culprit.
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*([\d,\s]+?)\s*(?:The tasks|$)")
_LEFT = re.compile(r"process ([\d, ]+) of \d+ left the run")


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger): alive but never running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class LocalRun:
    """N child processes with prefixed, interleaved output; stop them all when one fails."""

    def __init__(self, commands: list[list[str]], envs: list[dict], out=None):
        self.out = out or sys.stdout
        self._lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self._readers = []
        self.recent: list[collections.deque] = []  # each process's last lines, to name a culprit
        for i, (cmd, env) in enumerate(zip(commands, envs, strict=True)):
            p = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopping it stops its workers too
                text=True,
                errors="replace",
            )
            self.procs.append(p)
            self.recent.append(collections.deque(maxlen=200))
            self.say(f"process {i}: pid {p.pid}")
            t = threading.Thread(target=self._pump, args=(i, p), daemon=True)
            t.start()
            self._readers.append(t)

    def say(self, line: str) -> None:
        with self._lock:
            print(f"[launch] {line}", file=self.out, flush=True)

    def _pump(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            with self._lock:
                self.recent[i].append(line.rstrip())
                print(f"[p{i}] {line.rstrip()}", file=self.out, flush=True)

    def culprits(self, failed: int) -> tuple[list[int], str]:
        """-> (the processes that broke the run, how), given that ``failed`` exited first: a
        stopped process, or the ones the survivors' coordination service or our own error line
        names; else ``failed`` itself."""
        stopped = [i for i, p in enumerate(self.procs) if p.poll() is None and _stopped(p.pid)]
        if stopped:
            return stopped, "is stopped (not running: SIGSTOP?), so the others' heartbeat wait timed out"
        with self._lock:
            text = "\n".join(self.recent[failed])
        named: set[int] = set()
        for pattern in (_UNHEALTHY, _LEFT):
            for m in pattern.finditer(text):
                named |= {int(t) for t in re.findall(r"\d+", m.group(1))}
        named.discard(failed)
        if named:
            codes = {i: self.procs[i].poll() for i in named if i < len(self.procs)}
            how = "; ".join(
                f"process {i} {'is still running' if rc is None else _describe(rc)}"
                for i, rc in codes.items()
            )
            return sorted(codes), f"was named by process {failed} as gone (no heartbeat or connection: {how})"
        return [failed], ""

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the trainer checkpoints and exits), then SIGKILL after ``grace_s``."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.1)
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, timeout_s: float | None, grace_s: float = 10.0) -> int:
        """0 when all succeed; else a non-zero code after stopping the rest (124 on timeout)."""
        start = time.monotonic()
        interrupted = []
        old = {
            s: signal.signal(s, lambda signum, _: interrupted.append(signum))
            for s in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
                # Seen failing at once: a process killed from outside first, not one jax aborted
                # (SIGABRT) or one that exited on its own error because of it.
                failed.sort(key=lambda f: 0 if f[1] < 0 and -f[1] != signal.SIGABRT else 1)
                if failed:
                    i, rc = failed[0]
                    running = [j for j, c in enumerate(codes) if c is None]
                    self.say(
                        f"process {i} (pid {self.procs[i].pid}) {_describe(rc)}; "
                        f"stopping the others ({', '.join(map(str, running)) or 'none left'})"
                    )
                    time.sleep(0.5)  # its last lines (the coordination service names the dead peer)
                    culprits, how = self.culprits(i)
                    self.stop_all(grace_s)
                    self._drain()
                    if culprits == [i]:
                        self.say(f"FAILED: process {i} {_describe(rc)}")
                    else:
                        who = ", ".join(f"process {j}" for j in culprits)
                        self.say(f"FAILED: {who} {how}; process {i} {_describe(rc)} because of it")
                    return rc if rc > 0 else 128 - rc
                if all(c == 0 for c in codes):
                    self._drain()
                    self.say(f"all {len(codes)} processes finished")
                    return 0
                if interrupted:
                    self.say(f"{signal.Signals(interrupted[0]).name} received: stopping all processes")
                    self.stop_all(grace_s)
                    self._drain()
                    return 128 + interrupted[0]
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    running = [j for j, c in enumerate(codes) if c is None]
                    self.say(
                        f"FAILED: timeout after {timeout_s:.0f}s; still running: "
                        + ", ".join(f"process {j}" for j in running)
                    )
                    self.stop_all(grace_s)
                    self._drain()
                    return 124
                time.sleep(0.1)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _drain(self) -> None:
        for t in self._readers:
            t.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    child_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, child_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m dflash_jax.launch",
        description=__doc__.split("\n\n")[0],
        epilog="everything after -- goes to the entry point",
    )
    p.add_argument("--local-processes", type=int, required=True, metavar="N")
    p.add_argument("--devices-per-process", type=int, default=1, metavar="D")
    p.add_argument(
        "--platform",
        choices=("cpu", "gpu"),
        default="cpu",
        help="cpu: D simulated devices each; gpu: D local GPUs each",
    )
    p.add_argument("--module", default="dflash_jax.train", help="the entry point (default: dflash_jax.train)")
    p.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="stop everything after S seconds (exit 124)"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=30,
        metavar="S",
        help="a silent peer is declared dead after S seconds",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        metavar="S",
        help="SIGTERM -> SIGKILL delay when stopping processes",
    )
    args = p.parse_args(argv)
    if args.local_processes < 1 or args.devices_per_process < 1:
        p.error("--local-processes and --devices-per-process must be >= 1")
    coordinator = f"127.0.0.1:{free_port()}"
    n = args.local_processes
    commands = [[sys.executable, "-m", args.module, *child_args] for _ in range(n)]
    envs = [
        child_env(
            dict(os.environ),
            coordinator=coordinator,
            num=n,
            index=i,
            devices=args.devices_per_process,
            platform=args.platform,
            heartbeat=args.heartbeat_timeout,
        )
        for i in range(n)
    ]
    print(
        f"[launch] {n} processes x {args.devices_per_process} {args.platform} devices, coordinator {coordinator}",
        flush=True,
    )
    run = LocalRun(commands, envs)
    return run.wait(args.timeout, grace_s=args.grace)


if __name__ == "__main__":
    sys.exit(main())
