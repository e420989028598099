"""A lost process in a two-process `jax.distributed` job on 127.0.0.1 (2 CPU devices each).

Checked: once a checkpoint is committed, SIGKILL one process; the other exits within a
few seconds with exit status 75 and a message naming the lost process (axcore.platform.peer_watch;
without it, it would wait in a collective until JAX's heartbeat timeout and then abort).
Restarting both with the same run directory resumes from the last committed checkpoint,
recomputes the same losses as before the loss and finishes. Every process runs in its
own process group, which is killed on any failure or timeout. (Also: the lost-process
settings from the environment.)
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from axcore.platform.distributed import DistributedError, distributed_settings
from axcore.testing import TINY_OVERRIDES, host_devices_env

# Seconds a launch may take to commit its first checkpoint, or to finish.
LAUNCH_TIMEOUT = 180
# Seconds the surviving process may take to stop after its peer is killed.
STOP_TIMEOUT = 30
# JAX's heartbeat timeout for these runs: the bound if the peer watch failed to stop the survivor.
HEARTBEAT_TIMEOUT = 10
# Exit status of a process stopped because a peer was lost (axcore.platform.peer_watch.PEER_LOST_EXIT).
PEER_LOST_EXIT = 75
CHECKPOINT_EVERY = 4
LOSS_RTOL = 1e-5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(run_dir, steps, process_id, port):
    overrides = [
        *TINY_OVERRIDES,
        f"trainer.run_dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        f"trainer.checkpoint.every_n_steps={CHECKPOINT_EVERY}",
        "trainer.sample.num_tokens=4",
    ]
    command = [sys.executable, "-m", "axcore.cli", "train", "default"]
    command += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id)]
    for override in overrides:
        command += ["--set", override]
    return command


class Job:
    """Two `axcore train` processes, each in its own process group; `close` kills what is left."""

    def __init__(self, cwd, run_dir, steps, name):
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB", "AXCORE_"))}
        env = {**host_devices_env(2, base), "AXCORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT)}
        port = _free_port()
        self.paths = [pathlib.Path(cwd) / f"{name}-process{i}.log" for i in range(2)]
        self.procs, self.logs = [], []
        try:
            for i, path in enumerate(self.paths):
                self.logs.append(open(path, "w"))
                self.procs.append(
                    subprocess.Popen(
                        _command(run_dir, steps, i, port), env=env, cwd=cwd, stdout=self.logs[-1],
                        stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )
        except BaseException:
            self.close()
            raise

    def kill(self, i):
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait()

    def text(self, i):
        return self.paths[i].read_text(errors="replace")

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for log in self.logs:
            log.close()


def _committed(run_dir):
    return sorted(int(p.parent.name) for p in (pathlib.Path(run_dir) / "checkpoints").glob("*/commit_success.txt"))


def _records(text):
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # A line cut short by the kill.
            pass
    return {r["step"]: r["train/loss"] for r in records}


def _metrics_text(run_dir):
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return path.read_text() if path.exists() else ""


def _wait_for_commit_and_progress(job, run_dir):
    """Waits until a checkpoint is committed and two more steps are logged after it."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline:
        for i, proc in enumerate(job.procs):
            assert proc.poll() is None, f"process {i} ended early:\n{job.text(i)[-3000:]}"
        steps = _committed(run_dir)
        logged = _records(_metrics_text(run_dir))
        if steps and logged and max(logged) >= steps[-1] + 2:
            return
        time.sleep(0.05)
    pytest.fail(f"no checkpoint committed within {LAUNCH_TIMEOUT} s:\n{job.text(0)[-3000:]}")


def _wait_for_stop(job, i):
    """(exit status, seconds) of process i after its peer was killed."""
    start = time.monotonic()
    try:
        status = job.procs[i].wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"process {i} still running {STOP_TIMEOUT} s after its peer was killed:\n{job.text(i)[-3000:]}")
    return status, time.monotonic() - start


@pytest.mark.slow
def test_killed_process_stops_its_peer_and_the_restart_resumes(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(tmp_path, run_dir, 200, "first")
    try:
        _wait_for_commit_and_progress(job, run_dir)
        job.kill(1)
        status, seconds = _wait_for_stop(job, 0)
    finally:
        job.close()
    text = job.text(0)
    assert status == PEER_LOST_EXIT, text[-3000:]
    assert "lost process 1 of this 2-process job" in text, text[-3000:]
    assert "Restart all 2 processes with the same run directory" in text
    assert seconds < HEARTBEAT_TIMEOUT, seconds  # The watch, not JAX's heartbeat, stopped it.

    before = _metrics_text(run_dir)
    logged = _records(before)
    last = _committed(run_dir)[-1]
    steps = last + 3
    job = Job(tmp_path, run_dir, steps, "restart")
    try:
        for proc in job.procs:
            proc.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        job.close()
    for i, proc in enumerate(job.procs):
        assert proc.returncode == 0, job.text(i)[-3000:]
    assert f"Resumed from step {last} in {run_dir}" in job.text(0)
    assert f"Finished step {steps}" in job.text(0)
    after = [json.loads(line) for line in _metrics_text(run_dir).splitlines()]
    # The records of steps after the restored checkpoint were dropped on resume and redone: each step once.
    assert [r["step"] for r in after] == list(range(1, steps + 1))
    resumed = {r["step"]: r["train/loss"] for r in after if r["step"] > last}
    # Steps done before the kill and again after the resume: the same losses.
    again = sorted(set(resumed) & set(logged))
    assert again, (last, sorted(logged))
    for step in again:
        assert abs(resumed[step] - logged[step]) <= LOSS_RTOL * abs(logged[step]), (step, resumed[step], logged[step])


@pytest.mark.slow
def test_killed_coordinator_stops_the_other_process(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(tmp_path, run_dir, 200, "first")
    try:
        _wait_for_commit_and_progress(job, run_dir)
        job.kill(0)
        status, seconds = _wait_for_stop(job, 1)
    finally:
        job.close()
    text = job.text(1)
    # The watch sees process 0's connection close; JAX sees its coordination service go at
    # the same moment, and its abort (SIGABRT) may come first.
    if status == PEER_LOST_EXIT:
        assert "lost process 0 of this 2-process job" in text, text[-3000:]
    else:
        assert status == -signal.SIGABRT, (status, text[-3000:])
        assert "JAX distributed service detected fatal errors" in text, text[-3000:]
    assert seconds < HEARTBEAT_TIMEOUT, seconds


def test_lost_process_settings_come_from_the_environment():
    flags = ("127.0.0.1:1234", 2, 0)
    settings = distributed_settings(*flags, environ={})
    assert (settings.heartbeat_timeout, settings.watch_peers) == (100, True)
    settings = distributed_settings(*flags, environ={"AXCORE_HEARTBEAT_TIMEOUT": "10", "AXCORE_WATCH_PEERS": "0"})
    assert (settings.heartbeat_timeout, settings.watch_peers) == (10, False)
    slurm = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    slurm = {**slurm, "SLURM_STEP_NODELIST": "node1", "AXCORE_HEARTBEAT_TIMEOUT": "30"}
    assert distributed_settings(environ=slurm).heartbeat_timeout == 30
    with pytest.raises(DistributedError, match="AXCORE_HEARTBEAT_TIMEOUT must be an integer"):
        distributed_settings(*flags, environ={"AXCORE_HEARTBEAT_TIMEOUT": "soon"})
    with pytest.raises(DistributedError, match="AXCORE_WATCH_PEERS must be 1 or 0"):
        distributed_settings(*flags, environ={"AXCORE_WATCH_PEERS": "maybe"})
