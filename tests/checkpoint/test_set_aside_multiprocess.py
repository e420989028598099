"""Two local processes (jax.distributed, 4 CPU devices each) set a damaged step aside together.

Both must restore the same older step, name the same moved directory (process 0
renames it; the others wait for the rename), and then save the step afresh.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("checkpoint_set_aside_worker.py")
BACKENDS = ["orbax", "tensorstore"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    directory, port = tmp_path_factory.mktemp("set_aside"), _free_port()
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
    by_key = {}
    for i, out in enumerate(outputs):
        for line in out.splitlines():
            if line.startswith("RESULT "):
                _, name, rest = line.split(" ", 2)
                by_key[(i, name)] = rest
    return by_key, outputs, directory


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_processes_set_the_step_aside_and_save_it_again(results, backend):
    by_key, outputs, directory = results
    for i in range(2):
        assert (i, backend) in by_key, f"process {i} output:\n{outputs[i][-4000:] if i < len(outputs) else ''}"
        assert by_key[(i, backend)].startswith("OK "), f"process {i}: {by_key[(i, backend)]}"
    moved = {by_key[(i, backend)].split(" ", 1)[1] for i in range(2)}
    assert len(moved) == 1, moved  # The same name in both processes.
    (name,) = moved
    assert name.startswith(f"{backend}/{'10' if backend == 'orbax' else 'step_00000010'}.corrupt-"), name
    assert (directory / name).is_dir()
