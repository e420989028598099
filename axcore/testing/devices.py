"""Checks that need several JAX devices, run in a fresh process on host CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_host_device_worker(worker: str | os.PathLike, timeout: float, devices: int = 8) -> dict:
    """The JSON object on the last stdout line of `python worker`, run on `devices` host CPU devices.

    A fresh process, since JAX fixes the device count when it starts (`XLA_FLAGS`
    `--xla_force_host_platform_device_count`, `JAX_PLATFORMS=cpu`). Raises AssertionError
    with the worker's stderr tail if it exits non-zero; subprocess.TimeoutExpired after `timeout` s.
    """
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    env.pop("SKIP_KERNELS", None)  # A worker's debugging switch, never inherited.
    proc = subprocess.run([sys.executable, str(Path(worker))], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
