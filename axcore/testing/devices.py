"""Checks that need several JAX devices, run in a fresh process on host CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def host_devices_env(devices: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default `os.environ`) for a fresh JAX process on `devices` host CPU devices.

    Sets `JAX_PLATFORMS=cpu` and the device count in `XLA_FLAGS`, keeping every other flag
    already there (a test session's compile flags, a user's dump options) and replacing an
    earlier device count.
    """
    env = dict(os.environ if base is None else base)
    kept = [flag for flag in env.get("XLA_FLAGS", "").split() if not flag.startswith(_DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*kept, f"{_DEVICE_COUNT_FLAG}={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_host_device_worker(worker: str | os.PathLike, timeout: float, devices: int = 8) -> dict:
    """The JSON object on the last stdout line of `python worker`, run on `devices` host CPU devices.

    A fresh process, since JAX fixes the device count when it starts (`XLA_FLAGS`
    `--xla_force_host_platform_device_count`, `JAX_PLATFORMS=cpu`). Raises AssertionError
    with the worker's stderr tail if it exits non-zero; subprocess.TimeoutExpired after `timeout` s.
    """
    env = host_devices_env(devices)
    env.pop("SKIP_KERNELS", None)  # A worker's debugging switch, never inherited.
    proc = subprocess.run([sys.executable, str(Path(worker))], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
