"""A checkpoint saved on a (data=2, fsdp=2, tensor=2) mesh restores bit-identically on one
device and on a (fsdp=4, tensor=2) mesh, into each mesh's own shardings, and training
continues there with the same losses (both checkpoint backends; 8 CPU devices in a
subprocess running restore_across_meshes_worker.py)."""

import json
import pathlib
import subprocess
import sys

import pytest

from axcore.testing import host_devices_env

WORKER = pathlib.Path(__file__).parent / "restore_across_meshes_worker.py"
# Steps 5 and 6 on two meshes compute the same math in another reduction order (float32).
LOSS_RTOL = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["orbax", "tensorstore"])
def test_restore_on_other_meshes_and_continue(backend):
    env = host_devices_env(8)
    proc = subprocess.run([sys.executable, str(WORKER), backend], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["restored_equal"] == {"1": True, "fsdp4_tensor2": True}
    # Restored into the target mesh's layout: replicated on one device, split 4 x 2 on the other.
    assert all("'" not in spec for spec in result["restored_shardings"]["1"])  # No mesh axis named.
    other_specs = " ".join(result["restored_shardings"]["fsdp4_tensor2"])
    assert "'fsdp'" in other_specs and "'tensor'" in other_specs
    one, other = result["losses"]["1"], result["losses"]["fsdp4_tensor2"]
    assert len(one) == len(other) == 2
    for a, b in zip(one, other):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (one, other)
