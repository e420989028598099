"""Multi-process training on one machine: two `axcore train` processes with 2 CPU devices
each, joined through `jax.distributed` on 127.0.0.1 (gloo collectives), as the command
line, Slurm's `srun` and a Kubernetes JobSet would start them.

Checked: the processes join (the run sees 4 devices), train and checkpoint from both
processes, resume from that checkpoint, and log the same losses as one process with 4
devices reading both data shards (`input.data_shards=2`); each process reads only its
own data shard (half the rows of every batch: the rows and tokens each process reports
add up to the one process's). Every launch is bounded in time and its processes are
killed on any failure.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from axcore.testing import TINY_OVERRIDES, host_devices_env

pytestmark = pytest.mark.slow

# Seconds one launch (both processes) may take before everything is killed.
LAUNCH_TIMEOUT = 240
# Relative loss difference allowed against one process with as many devices (gloo's
# all-reduce may sum in another order than XLA:CPU's in-process one).
LOSS_RTOL = 1e-5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_in(low: int, high: int) -> int:
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high}")


def _overrides(run_dir, steps):
    return [
        *TINY_OVERRIDES,
        f"trainer.run_dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.checkpoint.every_n_steps=2",
        "trainer.sample.num_tokens=4",
    ]


def _command(overrides, extra=()):
    command = [sys.executable, "-m", "axcore.cli", "train", "default", *extra]
    for override in overrides:
        command += ["--set", override]
    return command


def _launch(commands_and_envs, cwd):
    """Starts every (command, env) at once; waits for all; kills all on failure or timeout."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB", "AXCORE_"))}
    procs = []
    try:
        for i, (command, env) in enumerate(commands_and_envs):
            log = open(pathlib.Path(cwd) / f"process{i}.log", "w")
            full_env = {**host_devices_env(2, base), **env}
            procs.append((subprocess.Popen(command, env=full_env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT), log))
        for proc, _ in procs:
            proc.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = [(pathlib.Path(cwd) / f"process{i}.log").read_text() for i in range(len(procs))]
    for (proc, _), text in zip(procs, logs):
        assert proc.returncode == 0, text[-3000:]
    return logs


def _losses(run_dir):
    records = [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records}


def _instance_type(run_dir):
    text = (pathlib.Path(run_dir) / "config.yaml").read_text()
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if "instance_type:" in line)


def _reads(log):
    """[(shards, rows per batch, rows read, tokens read)] of the `Input: process i ...` lines of a process's log."""
    shards = re.findall(r"Input: process \d+ reads data shards \[([\d, ]*)\] of 2 \((\d+) of 4 rows per batch\)", log)
    totals = re.findall(r"Input: process \d+ read (\d+) rows, (\d+) tokens", log)
    assert len(shards) == len(totals) == 1, log[-3000:]
    return shards[0][0], int(shards[0][1]), int(totals[0][0]), int(totals[0][1])


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Losses of 6 steps in one process with 4 CPU devices (the same data-parallel mesh) reading both
    data shards, and what it read."""
    root = tmp_path_factory.mktemp("single")
    env = {"XLA_FLAGS": host_devices_env(4)["XLA_FLAGS"]}
    [log] = _launch([(_command([*_overrides(root / "run", 6), "input.data_shards=2"]), env)], root)
    assert _instance_type(root / "run") == "cpu-4"
    return _losses(root / "run"), _reads(log)


def test_two_processes_train_checkpoint_and_resume_like_one(tmp_path, single_process):
    single_process_losses, (shards, rows_per_batch, rows, tokens) = single_process
    assert (shards, rows_per_batch, rows) == ("0, 1", 4, 6 * 4)
    run_dir = tmp_path / "run"
    # Joined from the command line: 4 steps, checkpoints at 2 and 4 written by both processes.
    port = _free_port()
    flags = lambda i: ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]  # noqa: E731
    logs = _launch([(_command(_overrides(run_dir, 4), flags(i)), {}) for i in range(2)], tmp_path)
    assert _instance_type(run_dir) == "cpu-4"  # 2 processes x 2 devices.
    assert "Sample:" in logs[0] and "Sample:" not in logs[1]  # Only process 0 prints and writes.
    reads = [_reads(log) for log in logs]

    # Resumed as srun would start it: JAX's own Slurm detection (coordinator 127.0.0.1,
    # port from the job id), steps 5 and 6 from the step-4 checkpoint.
    port = _free_port_in(61440, 65535)
    slurm = lambda i: {  # noqa: E731
        "SLURM_JOB_ID": str(port - 61440), "SLURM_NTASKS": "2", "SLURM_PROCID": str(i),
        "SLURM_LOCALID": str(i), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_NUM_NODES": "1",
    }
    logs = _launch([(_command(_overrides(run_dir, 6)), slurm(i)) for i in range(2)], tmp_path)
    assert "Resumed from step 4" in logs[0]
    resumed = [_reads(log) for log in logs]
    # Each process read only its own shard: 2 of the 4 rows of every batch, and together exactly the
    # tokens the one process read from both shards over the same 6 steps.
    assert [r[:3] for r in reads] == [("0", 2, 4 * 2), ("1", 2, 4 * 2)]
    assert [r[:3] for r in resumed] == [("0", 2, 2 * 2), ("1", 2, 2 * 2)]
    assert sum(r[3] for r in reads + resumed) == tokens and all(r[3] > 0 for r in reads + resumed)
    losses = _losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step, loss in single_process_losses.items():
        assert abs(losses[step] - loss) <= LOSS_RTOL * abs(loss), (step, losses[step], loss)


def test_jobset_pods_join_from_the_jobset_variables(tmp_path):
    run_dir = tmp_path / "run"
    port = _free_port()
    jobset = lambda i: {  # noqa: E731
        "JOBSET_NAME": "axcore", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0",
        "JOB_COMPLETION_INDEX": str(i), "AXCORE_NUM_PROCESSES": "2",
        # Pod names do not resolve here: the coordinator is given, as a manifest may.
        "AXCORE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
    }
    _launch([(_command(_overrides(run_dir, 2)), jobset(i)) for i in range(2)], tmp_path)
    assert _instance_type(run_dir) == "cpu-4"
    assert sorted(_losses(run_dir)) == [1, 2]
