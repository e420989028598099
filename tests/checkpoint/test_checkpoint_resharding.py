"""Save over 8 devices, restore into other shardings (a subprocess with 8 CPU devices)."""

import subprocess
import sys
from pathlib import Path

import pytest

from axcore.testing import host_devices_env

WORKER = Path(__file__).with_name("checkpoint_reshard_worker.py")
BACKENDS = ["orbax", "tensorstore"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = host_devices_env(8)
    directory = tmp_path_factory.mktemp("reshard")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(directory), *BACKENDS],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return {name: rest for _, name, rest in lines}, proc


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_into_other_shardings(results, backend):
    by_backend, proc = results
    assert backend in by_backend, f"worker exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert by_backend[backend] == "OK", by_backend[backend]
