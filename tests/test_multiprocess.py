"""Multi-process training on one machine: jax.distributed over gloo, the local launcher, logical
data shards, and checkpoints that move between process counts.

The end-to-end tests start real processes with ``python -m dflash_jax.launch`` (2 processes x 4
CPU devices) and compare them with this pytest process (1 process x 8 devices, conftest.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_jax import distributed
from dflash_jax.data import shards

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 1500  # generous: CI boxes are small and shared; a hang still ends


# --------------------------------------------------------------------------- flags and environment


def _args(**kw):
    base = dict(coordinator=None, num_processes=None, process_id=None, heartbeat_timeout=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_distributed_config_from_flags_env_and_slurm():
    assert distributed.config_from(_args(), {}) is None
    cfg = distributed.config_from(
        _args(coordinator="10.0.0.1:1234", num_processes=4, process_id=3, heartbeat_timeout=20), {}
    )
    assert (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.heartbeat_timeout_s) == (
        "10.0.0.1:1234",
        4,
        3,
        20,
    )
    env = {"JAX_COORDINATOR_ADDRESS": "host:99", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    cfg = distributed.config_from(_args(), env)
    assert (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.heartbeat_timeout_s) == (
        "host:99",
        2,
        1,
        100,
    )
    # flags win over the environment
    assert distributed.config_from(_args(process_id=0), env).process_id == 0
    # SLURM with several tasks: jax detects everything
    slurm = distributed.config_from(_args(), {"SLURM_NTASKS": "8"})
    assert slurm is not None and slurm.coordinator is None and slurm.num_processes is None
    assert distributed.config_from(_args(), {"SLURM_NTASKS": "1"}) is None
    with pytest.raises(ValueError, match="--num-processes, --process-id not given"):
        distributed.config_from(_args(coordinator="h:1"), {})
    with pytest.raises(ValueError, match="process_id must be in"):
        distributed.config_from(_args(coordinator="h:1", num_processes=2, process_id=2), {})
    with pytest.raises(ValueError, match="HOST:PORT"):
        distributed.config_from(_args(coordinator="nohost", num_processes=2, process_id=0), {})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID must be an integer"):
        distributed.config_from(_args(), {**env, "JAX_PROCESS_ID": "one"})


# --------------------------------------------------------------------------- logical data shards


def test_shard_assignment_and_state_merge():
    assert list(shards.shards_of_process(4, 0, 2)) == [0, 1]
    assert list(shards.shards_of_process(4, 1, 2)) == [2, 3]
    assert list(shards.shards_of_process(4, 0, 1)) == [0, 1, 2, 3]
    with pytest.raises(
        ValueError, match="data.shards=3 must be a positive multiple of the number of processes"
    ):
        shards.shards_of_process(3, 0, 2)
    assert shards.resolve_num_shards(None, 2) == 2
    saved = {"num_shards": 4, "shards": {str(i): {} for i in range(4)}}
    assert shards.resolve_num_shards(None, 2, saved) == 4
    with pytest.raises(ValueError, match="resume with data.shards=4"):
        shards.resolve_num_shards(2, 2, saved)
    merged = shards.merge_states(
        [{"num_shards": 2, "shards": {"1": {"x": 1}}}, {"num_shards": 2, "shards": {"0": {"x": 0}}}]
    )
    assert merged == {"num_shards": 2, "shards": {"0": {"x": 0}, "1": {"x": 1}}}
    with pytest.raises(ValueError, match="disagree"):
        shards.merge_states([{"num_shards": 2, "shards": {}}, {"num_shards": 4, "shards": {}}])


def test_global_batches_do_not_depend_on_the_process_count(qwen):
    """1 process reading shards 0-3 yields exactly the rows that 2 processes (shards 0-1, 2-3)
    yield together, and a state saved by either continues on the other."""
    from dflash_jax.data.pipeline import DataConfig

    cfg = DataConfig(max_records=60, max_length=64, batch_size=4, prefetch=0, seed=1)
    one = shards.ShardedBatchIterator(cfg, qwen, num_shards=4)
    two = [
        shards.ShardedBatchIterator(cfg, qwen, num_shards=4, process_index=p, process_count=2) for p in (0, 1)
    ]
    for _ in range(3):
        whole, parts = next(one), [next(it) for it in two]
        assert whole["input_ids"].shape == (4, 64) and parts[0]["input_ids"].shape == (2, 64)
        for k in whole:
            np.testing.assert_array_equal(whole[k], np.concatenate([p[k] for p in parts]))
    # 2 processes' states -> 1 process, and 1 process's state -> 2 processes
    merged = shards.merge_states([it.get_state() for it in two])
    assert merged == one.get_state()
    resumed_one = shards.ShardedBatchIterator(cfg, qwen, num_shards=4)
    resumed_one.set_state(merged)
    resumed_two = [
        shards.ShardedBatchIterator(cfg, qwen, num_shards=4, process_index=p, process_count=2) for p in (0, 1)
    ]
    for it in resumed_two:
        it.set_state(one.get_state())
    expected = next(one)
    np.testing.assert_array_equal(next(resumed_one)["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(
        np.concatenate([next(it)["input_ids"] for it in resumed_two]), expected["input_ids"]
    )
    with pytest.raises(ValueError, match="no position for shards"):
        two[1].set_state(two[0].get_state())


# --------------------------------------------------------------------------- the launcher


def _launch(args: list[str], *, module_dir: str = "", xla_flags: str = "", timeout: float = LAUNCH_TIMEOUT_S):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), module_dir) if p))
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    cmd = [sys.executable, "-m", "dflash_jax.launch", *args]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _write_module(tmp_path: Path, body: str) -> str:
    (tmp_path / "probe_entry.py").write_text(textwrap.dedent(body))
    return str(tmp_path)


def test_launcher_environment_and_first_failure_stops_the_rest(tmp_path):
    """Each process gets its id, the coordinator and its device count; when process 1 fails the
    launcher stops process 0 (which would sleep for a minute) and names process 1."""
    path = _write_module(
        tmp_path,
        """
        import os, sys, time
        i = int(os.environ["JAX_PROCESS_ID"])
        print("id", i, os.environ["JAX_NUM_PROCESSES"], os.environ["JAX_COORDINATOR_ADDRESS"],
              os.environ["JAX_NUM_CPU_DEVICES"], os.environ["XLA_FLAGS"], sys.argv[1:], flush=True)
        if i == 1:
            sys.exit(3)
        time.sleep(60)
        """,
    )
    t0 = time.monotonic()
    r = _launch(
        [
            "--local-processes",
            "2",
            "--devices-per-process",
            "4",
            "--module",
            "probe_entry",
            "--grace",
            "2",
            "--",
            "x=1",
        ],
        module_dir=path,
        xla_flags="--xla_force_host_platform_device_count=8",
    )
    assert time.monotonic() - t0 < 40, r.stdout
    assert r.returncode == 3, r.stdout
    for i in (0, 1):
        assert re.search(
            rf"\[p{i}\] id {i} 2 127\.0\.0\.1:\d+ 4 --xla_force_host_platform_device_count=4 \['x=1'\]",
            r.stdout,
        ), r.stdout
    assert "FAILED: process 1 exited with code 3" in r.stdout


def test_launcher_timeout_names_the_running_processes(tmp_path):
    path = _write_module(tmp_path, "import time\ntime.sleep(60)\n")
    r = _launch(
        ["--local-processes", "2", "--module", "probe_entry", "--timeout", "3", "--grace", "1"],
        module_dir=path,
    )
    assert r.returncode == 124, r.stdout
    assert "timeout after 3s; still running: process 0, process 1" in r.stdout


def _start_two_processes(path):
    """Two processes of ``probe_entry`` (in ``path``) joined by JAX_* variables with a 5 s
    heartbeat, as a cluster starts them (no launcher), 2 CPU devices each."""
    from dflash_jax import launch

    coordinator = f"127.0.0.1:{launch.free_port()}"
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), path]))
    return [
        subprocess.Popen(
            [sys.executable, "-m", "probe_entry"],
            env=launch.child_env(
                base, coordinator=coordinator, num=2, index=i, devices=2, platform="cpu", heartbeat=5
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]


def test_dead_peer_is_named_by_the_survivor_within_the_heartbeat_timeout(tmp_path):
    """Without the launcher (as on a cluster): process 1 dies after a collective; process 0,
    waiting in the next one, aborts within the heartbeat timeout with an error naming task 1."""

    path = _write_module(
        tmp_path,
        """
        import os, time
        from dflash_jax import distributed
        distributed.initialize_from(None)
        import jax
        print("joined", jax.process_index(), jax.device_count(), distributed.allgather_json(jax.process_index()), flush=True)
        if jax.process_index() == 1:
            os._exit(7)
        time.sleep(1)
        distributed.barrier("never reached by process 1")
        print("barrier passed", flush=True)
        """,
    )
    procs = _start_two_processes(path)
    try:
        out1, _ = procs[1].communicate(timeout=300)
        t_dead = time.monotonic()
        out0, _ = procs[0].communicate(timeout=120)
        waited = time.monotonic() - t_dead
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "joined 1 4 [0, 1]" in out1 and procs[1].returncode == 7
    assert "joined 0 4 [0, 1]" in out0, out0[-3000:]
    assert "barrier passed" not in out0
    assert procs[0].returncode != 0
    assert waited < 60, waited
    assert re.search(r"unhealthy \(stopped sending heartbeats\):\s*1\b", out0), out0[-3000:]


def test_26_6_survivor_names_the_killed_peer_in_its_one_error_line(tmp_path):
    """Issue 26: started by JAX_* variables (no launcher), process 1 is SIGKILLed; process 0's next
    collective fails in gloo ("Connection closed by peer", naming nobody): its error line names
    process 1, with no traceback."""

    path = _write_module(
        tmp_path,
        """
        import os, signal, sys, time
        from dflash_jax import distributed
        from dflash_jax.cli import cli

        @distributed.exit_on_error
        @cli
        def main():
            distributed.initialize_from(None)
            import jax
            print("joined", distributed.allgather_json(jax.process_index()), flush=True)
            if jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1)
            distributed.allgather_json("never answered")
            print("allgather passed", flush=True)

        sys.exit(main())
        """,
    )
    procs = _start_two_processes(path)
    try:
        out0, _ = procs[0].communicate(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert procs[1].returncode == -signal.SIGKILL
    assert "joined [0, 1]" in out0 and "allgather passed" not in out0, out0[-3000:]
    errors = [ln for ln in out0.splitlines() if ln.startswith("error:")]
    assert errors and re.match(r"error: process 1 of 2 left the run", errors[0]), out0[-3000:]
    assert "Traceback" not in out0, out0[-3000:]


def test_26_6_launcher_names_a_stopped_peer_not_the_survivor_it_aborts(tmp_path):
    """Issue 26: process 1 is SIGSTOPped; after the heartbeat timeout jax aborts process 0
    (SIGABRT). The launcher used to report "process 0 was killed by SIGABRT"; it names process 1."""
    path = _write_module(
        tmp_path,
        """
        import os, signal
        from dflash_jax import distributed
        distributed.initialize_from(None)
        import jax
        print("joined", distributed.allgather_json(jax.process_index()), flush=True)
        if jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        distributed.barrier("never reached by process 1")
        """,
    )
    r = _launch(
        ["--local-processes", "2", "--module", "probe_entry", "--heartbeat-timeout", "5", "--grace", "2"],
        module_dir=path,
        timeout=300,
    )
    assert r.returncode != 0, r.stdout[-3000:]
    failed = [ln for ln in r.stdout.splitlines() if "FAILED:" in ln]
    assert failed and re.search(r"FAILED: process 1 is stopped", failed[-1]), r.stdout[-3000:]


# --------------------------------------------------------------------------- training end to end


COMMON = [
    "train.steps=4",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "data.shards=2",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _train_two_processes(run_dir: Path, *extra: str, timeout_s: int = LAUNCH_TIMEOUT_S):
    r = _launch(
        [
            "--local-processes",
            "2",
            "--devices-per-process",
            "4",
            "--timeout",
            str(timeout_s),
            "--",
            "--config",
            "tiny",
            "--quiet",
            f"output_dir={run_dir}",
            *COMMON,
            *extra,
        ],
        timeout=timeout_s + 60,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    return r


def _train_one_process(run_dir: Path, *extra: str, resume: bool = False):
    from dflash_jax.train import run
    from dflash_jax.training.run_config import load_run_config

    return run(load_run_config("tiny", [f"output_dir={run_dir}", *COMMON, *extra]), quiet=True, resume=resume)


def _copy_until(src: Path, dst: Path, step: int) -> Path:
    """A run directory as it was after checkpoint ``step`` (later checkpoints and metrics gone)."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if ckpt.name.isdigit() and int(ckpt.name) > step:
            shutil.rmtree(ckpt)
    (dst / "metrics.jsonl").unlink()
    return dst


def test_two_processes_match_one_and_checkpoints_cross_process_counts(tmp_path):
    """tiny config, 4 steps, mesh data 2 x fsdp 2 x tensor 2: 2 processes x 4 devices give the
    losses of 1 process x 8 devices; a step-2 checkpoint of either resumes on the other and
    continues with the uninterrupted run's losses."""
    one, two = tmp_path / "one", tmp_path / "two"
    _train_one_process(one)
    out = _train_two_processes(two).stdout
    ref = _losses(one)
    assert sorted(ref) == [1, 2, 3, 4]
    got = _losses(two)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [got[s] for s in range(1, 5)], [ref[s] for s in range(1, 5)], atol=1e-5, rtol=0
    )
    # process 0 alone logs INFO and writes outputs; process 1 prints no progress or result
    assert "[p0] outputs:" in out and "[p1] outputs:" not in out
    assert not re.search(r"\[p1\] .* INFO ", out)
    # written by 2 processes, resumed by 1
    a = _copy_until(two, tmp_path / "two_then_one", 2)
    res = _train_one_process(a, resume=True)
    assert res["start_step"] == 2 and res["step"] == 4
    got = _losses(a)
    assert sorted(got) == [3, 4]
    np.testing.assert_allclose([got[3], got[4]], [ref[3], ref[4]], atol=1e-5, rtol=0)
    # written by 1 process, resumed by 2
    b = _copy_until(one, tmp_path / "one_then_two", 2)
    _train_two_processes(b, "--resume")
    got = _losses(b)
    assert sorted(got) == [3, 4]
    np.testing.assert_allclose([got[3], got[4]], [ref[3], ref[4]], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_killed_process_stops_the_run_and_the_last_checkpoint_restores(tmp_path):
    """SIGKILL process 1 after the first checkpoint: the launcher exits non-zero within its
    bound, naming process 1, and the checkpoint left behind resumes."""
    from dflash_jax.checkpoint import Checkpointer

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "dflash_jax.launch", "--local-processes", "2", "--devices-per-process", "4",
        "--timeout", str(LAUNCH_TIMEOUT_S), "--grace", "5", "--",
        "--config", "tiny", "--quiet", f"output_dir={run_dir}",
        *[c for c in COMMON if not c.startswith("train.steps")], "train.steps=200",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, pids = [], {}
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        first_ckpt = run_dir / "checkpoints" / "2" / "commit_success.txt"
        os.set_blocking(proc.stdout.fileno(), False)
        while not first_ckpt.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-5000:]
            for line in iter(proc.stdout.readline, ""):
                lines.append(line)
                if m := re.match(r"\[launch\] process (\d): pid (\d+)", line):
                    pids[int(m.group(1))] = int(m.group(2))
            time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        t_kill = time.monotonic()
        os.set_blocking(proc.stdout.fileno(), True)
        rest, _ = proc.communicate(timeout=120)
        waited = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode != 0, out[-5000:]
    assert waited < 60, waited
    assert "FAILED: process 1 was killed by SIGKILL" in out
    ckpt = Checkpointer(run_dir / "checkpoints")
    last = ckpt.latest_step()
    ckpt.close()
    assert last is not None and last >= 2
    res = _train_one_process(run_dir, f"train.steps={last + 1}", resume=True)
    assert res["start_step"] == last and res["step"] == last + 1
