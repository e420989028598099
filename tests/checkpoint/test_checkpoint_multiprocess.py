"""Two local processes (jax.distributed, 4 CPU devices each) save and restore together."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("checkpoint_multiprocess_worker.py")
BACKENDS = ["orbax", "tensorstore"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    directory, port = tmp_path_factory.mktemp("multiprocess"), _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(directory), *BACKENDS],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=150)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for i, out in enumerate(outputs):
        for line in out.splitlines():
            if line.startswith("RESULT "):
                _, name, rest = line.split(" ", 2)
                results[(i, name)] = rest
    return results, outputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_save_and_restore(results, backend):
    by_key, outputs = results
    for i in range(2):
        assert (i, backend) in by_key, f"process {i} output:\n{outputs[i][-4000:] if i < len(outputs) else ''}"
        assert by_key[(i, backend)] == "OK", f"process {i}: {by_key[(i, backend)]}"
