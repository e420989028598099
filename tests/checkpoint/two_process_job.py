"""A two-process checkpoint job for the tests: the test side starts it, the worker side runs checks.

The test starts `worker` twice (process 0 and 1, joined through `jax.distributed` on
127.0.0.1, 4 CPU devices each) with `directory` and a list of names; the worker runs
`check(name, directory)` for each and prints `RESULT <name> OK [<what check returned>]` or
`RESULT <name> FAIL <traceback>`. Imported by the tests and by the worker scripts (which
find it beside themselves); it imports neither pytest nor axcore.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(worker: Path, directory: Path, names: Sequence[str], timeout: float = 150) -> tuple[dict, list[str]]:
    """Runs the two processes; `({(process, name): "OK ..." | "FAIL ..."}, [output of each process])`."""
    # Four host devices, keeping the caller's other XLA flags (the test session's compile flags).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), str(port), str(directory), *names],
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
            outputs.append(proc.communicate(timeout=timeout)[0])
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
    return by_key, outputs


def worker_main(check: Callable[[str, str], Any]) -> None:
    """The worker's main: `argv = PROCESS_ID PORT DIRECTORY NAME...`; one RESULT line per name."""
    import jax

    process_id, port, directory, names = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    for name in names:
        try:
            extra = check(name, directory)
            print(f"RESULT {name} OK" + ("" if extra is None else f" {extra}"), flush=True)
        except Exception:
            print(f"RESULT {name} FAIL {traceback.format_exc()!r}", flush=True)
    jax.distributed.shutdown()
