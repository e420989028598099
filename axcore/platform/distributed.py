"""Joining a multi-process job through `jax.distributed`, and feeding each process its share.

Where the settings come from, first match wins:

1. `axcore train --coordinator HOST:PORT --num-processes N --process-id I` (all three).
2. The environment variables `AXCORE_COORDINATOR_ADDRESS`, `AXCORE_NUM_PROCESSES`,
   `AXCORE_PROCESS_ID` (all three; e.g. from a launcher script).
3. A Kubernetes JobSet (`JOBSET_NAME` and `JOB_COMPLETION_INDEX` set, as the JobSet
   controller sets them in every pod of an indexed Job): process id
   `JOB_INDEX * pods_per_job + JOB_COMPLETION_INDEX` with `pods_per_job = N /
   REPLICATED_JOB_REPLICAS` (1 replica if unset), N from `AXCORE_NUM_PROCESSES` (the
   manifest sets it), coordinator `AXCORE_COORDINATOR_ADDRESS` if set, else the first
   pod's stable name `<JOBSET_NAME>-<REPLICATED_JOB_NAME>-0-0.<JOBSET_NAME>:<port>`
   (`AXCORE_COORDINATOR_PORT`, default 8476). JAX's own Kubernetes detection is not used:
   it needs the `kubernetes` client package and API permissions in the pod.
4. Slurm (`SLURM_JOB_ID`, `SLURM_NTASKS` > 1, `SLURM_PROCID`, `SLURM_LOCALID` and
   `SLURM_STEP_NODELIST` set, as `srun` sets them): `jax.distributed.initialize()` with no
   arguments, so JAX's own Slurm detection reads those variables (coordinator: the first
   node of the step's node list, on a port derived from the job id).

One process (none of the above, or N = 1) initializes nothing. `jax.distributed` must be
initialized before JAX's backend starts; `load_experiment(..., distributed=...)` does it
at the right moment (after XLA flags are set, before devices are counted).

Every process runs the same program on the global arrays; each process reads and builds
only the data shards its devices' rows hold and assembles the global batch from
process-local data (`axcore.data.device_loader`). Only process 0 writes the run's config, metrics, plots
and progress; checkpoints are written by every process (each its own shards).

When a process dies, the others stop too, since none can go on alone: at once, with a
message naming the lost process and exit status 75, through `axcore.platform.peer_watch` (off
with `AXCORE_WATCH_PEERS=0`); a process lost silently (host down, network cut) is caught
by JAX's heartbeat after `heartbeat_timeout` seconds (`AXCORE_HEARTBEAT_TIMEOUT`), which
aborts the others. Restarting all processes with the same run directory resumes from the
last committed checkpoint.

What process 0's coordinator service listens on (`coordinator_bind_address`): the
coordinator's own address, never every interface (JAX's default, `[::]:PORT`): the
host of `--coordinator HOST:PORT` (or its environment, JobSet or launcher variant)
resolved, IPv4 first, to an address of this machine, on its port. Where that host is
not an address of this machine (a load balancer's or NAT's address), the service
listens on every interface, with a warning that names the host and the way to choose:
`JAX_COORDINATOR_BIND_ADDRESS=ADDRESS:PORT`, which, when set, is always used as given.
Under Slurm the coordinator host is read by JAX from the node list, so JAX's default
applies there unless that variable is set.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from axcore.errors import AxcoreError, one_line

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "AXCORE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "AXCORE_NUM_PROCESSES"
ENV_PROCESS_ID = "AXCORE_PROCESS_ID"
ENV_COORDINATOR_PORT = "AXCORE_COORDINATOR_PORT"
# Lost-process settings (any source): DistributedSettings.heartbeat_timeout and .watch_peers.
ENV_HEARTBEAT_TIMEOUT = "AXCORE_HEARTBEAT_TIMEOUT"
ENV_WATCH_PEERS = "AXCORE_WATCH_PEERS"
# JAX's own variable for the coordinator service's listening address; used as given when set.
ENV_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"
# Port of the JobSet coordinator when AXCORE_COORDINATOR_PORT is unset (JAX's usual one).
DEFAULT_COORDINATOR_PORT = 8476
# Variables `srun` sets that JAX's Slurm detection needs.
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")
_ADDRESS = re.compile(r"[^\s:]+:\d+")


class DistributedError(AxcoreError):
    """Multi-process settings are incomplete or invalid, or the job could not be joined."""


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """How this process joins its job (None fields: JAX's cluster detection fills them)."""

    # HOST:PORT of process 0's coordinator service.
    coordinator_address: str | None
    # Processes in the job.
    num_processes: int | None
    # This process's index, 0 .. num_processes - 1.
    process_id: int | None
    # Where the settings came from: flags, environment, jobset or slurm.
    source: str
    # Seconds to wait for every process to join.
    initialization_timeout: int = 300
    # Seconds without a heartbeat before JAX counts a process as lost and aborts the others (JAX's default).
    heartbeat_timeout: int = 100
    # Stop at once with a clear message (exit 75) when another process dies (`axcore.platform.peer_watch`).
    watch_peers: bool = True


def _integer(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{what} must be an integer, got {value!r}.") from None


def _checked(address: Any, num: Any, pid: Any, source: str, names: tuple[str, str, str]) -> DistributedSettings:
    given = {names[0]: address, names[1]: num, names[2]: pid}
    missing = [name for name, value in given.items() if value in (None, "")]
    if missing:
        raise DistributedError(
            f"Multi-process settings from {source} are incomplete: {', '.join(missing)} missing; give all of "
            f"{', '.join(names)}."
        )
    num, pid = _integer(num, names[1]), _integer(pid, names[2])
    if num < 1:
        raise DistributedError(f"{names[1]} must be at least 1, got {num}.")
    if not 0 <= pid < num:
        raise DistributedError(f"{names[2]} must be in 0..{num - 1} for {num} processes, got {pid}.")
    if not _ADDRESS.fullmatch(str(address)):
        raise DistributedError(f"{names[0]} must be HOST:PORT (e.g. 10.0.0.1:8476), got {address!r}.")
    return DistributedSettings(str(address), num, pid, source)


def _jobset(environ: Mapping[str, str]) -> DistributedSettings:
    where = "the JobSet environment"
    num = _integer(environ.get(ENV_NUM_PROCESSES), f"{ENV_NUM_PROCESSES} (set it in the JobSet manifest)")
    replicas = _integer(environ.get("REPLICATED_JOB_REPLICAS", "1"), "REPLICATED_JOB_REPLICAS")
    if replicas < 1 or num % replicas:
        raise DistributedError(f"{ENV_NUM_PROCESSES}={num} is not a multiple of REPLICATED_JOB_REPLICAS={replicas}.")
    job_index = _integer(environ.get("JOB_INDEX", "0"), "JOB_INDEX")
    pid = job_index * (num // replicas) + _integer(environ["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")
    address = environ.get(ENV_COORDINATOR)
    if not address:
        name, job = environ["JOBSET_NAME"], environ.get("REPLICATED_JOB_NAME", "")
        if not job:
            raise DistributedError(f"REPLICATED_JOB_NAME is unset; set {ENV_COORDINATOR} in the manifest instead.")
        port = _integer(environ.get(ENV_COORDINATOR_PORT, DEFAULT_COORDINATOR_PORT), ENV_COORDINATOR_PORT)
        address = f"{name}-{job}-0-0.{name}:{port}"
    return _checked(address, num, pid, where, (ENV_COORDINATOR, ENV_NUM_PROCESSES, "the JobSet process id"))


def distributed_settings(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] = os.environ,
) -> DistributedSettings | None:
    """This process's multi-process settings (module docstring for the order), or None for one process.

    Raises:
        DistributedError: settings given partly, or out of range, naming the flag or variable.
    """
    if any(value is not None for value in (coordinator, num_processes, process_id)):
        settings = _checked(
            coordinator, num_processes, process_id, "the command line", ("--coordinator", "--num-processes", "--process-id")
        )
    elif any(environ.get(name) for name in (ENV_COORDINATOR, ENV_PROCESS_ID)) and "JOBSET_NAME" not in environ:
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        settings = _checked(*(environ.get(name) for name in names), "the environment", names)
    elif "JOBSET_NAME" in environ and "JOB_COMPLETION_INDEX" in environ:
        settings = _jobset(environ)
    elif all(name in environ for name in SLURM_VARIABLES):
        if _integer(environ["SLURM_NTASKS"], "SLURM_NTASKS") <= 1:
            return None
        settings = DistributedSettings(None, None, None, "slurm")
    else:
        return None
    if settings.num_processes is not None and settings.num_processes <= 1:
        return None
    return _with_failure_settings(settings, environ)


def _with_failure_settings(settings: DistributedSettings, environ: Mapping[str, str]) -> DistributedSettings:
    """`settings` with the lost-process settings from AXCORE_HEARTBEAT_TIMEOUT and AXCORE_WATCH_PEERS."""
    if environ.get(ENV_HEARTBEAT_TIMEOUT):
        timeout = _integer(environ[ENV_HEARTBEAT_TIMEOUT], ENV_HEARTBEAT_TIMEOUT)
        if timeout < 1:
            raise DistributedError(f"{ENV_HEARTBEAT_TIMEOUT} must be at least 1 (seconds), got {timeout}.")
        settings = dataclasses.replace(settings, heartbeat_timeout=timeout)
    if environ.get(ENV_WATCH_PEERS):
        value = environ[ENV_WATCH_PEERS].strip().lower()
        if value not in ("0", "1", "true", "false"):
            raise DistributedError(f"{ENV_WATCH_PEERS} must be 1 or 0, got {environ[ENV_WATCH_PEERS]!r}.")
        settings = dataclasses.replace(settings, watch_peers=value in ("1", "true"))
    return settings


def coordinator_bind_address(coordinator_address: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where process 0's coordinator service listens: `ADDRESS:PORT` (module docstring), or None for JAX's choice.

    None when `JAX_COORDINATOR_BIND_ADDRESS` is set (JAX reads it), when the coordinator
    is unknown (Slurm), or, with a logged warning, when its host is not an address of
    this machine. An IPv6 address is bracketed (`[::1]:8476`).
    """
    if environ.get(ENV_BIND_ADDRESS) or not coordinator_address:
        return None
    host, port = coordinator_address.rsplit(":", 1)
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, _, _, _, address in sorted(infos, key=lambda info: info[0] != socket.AF_INET):
        ip = address[0].split("%")[0]
        if ipaddress.ip_address(ip).is_unspecified:  # The user asked for every interface.
            return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((ip, 0))  # Binds only to an address of this machine.
            except OSError:
                continue
        return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
    logger.warning(
        "The coordinator host %r is not an address of this machine, so process 0's coordinator service listens "
        "on every interface (port %s); set %s=ADDRESS:%s to choose the one it listens on.",
        host, port, ENV_BIND_ADDRESS, port,
    )
    return None


def initialize_distributed(settings: DistributedSettings | None) -> None:
    """Joins the job (`jax.distributed.initialize`); nothing for None. Before JAX's backend starts.

    Process 0's coordinator service listens on `coordinator_bind_address` (module
    docstring). Then, with `settings.watch_peers`, starts `axcore.platform.peer_watch` (its address broadcast
    starts the backend: XLA flags must be set by then, as `load_experiment` does).

    Raises:
        DistributedError: the coordinator could not be reached or the job not formed in time.
    """
    if settings is None:
        return
    bind = coordinator_bind_address(settings.coordinator_address) if settings.process_id in (0, None) else None
    try:
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            coordinator_bind_address=bind,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            initialization_timeout=settings.initialization_timeout,
            heartbeat_timeout_seconds=settings.heartbeat_timeout,
        )
    except (RuntimeError, ValueError) as e:
        raise DistributedError(
            f"Could not join the multi-process job ({settings.source}, coordinator "
            f"{settings.coordinator_address or 'from Slurm'}, process {settings.process_id} of "
            f"{settings.num_processes}): {one_line(e)[:300]}. Check that every process started "
            f"with the same coordinator address and that it is reachable."
        ) from e
    logger.info("Joined as process %d of %d.", jax.process_index(), jax.process_count())
    if settings.watch_peers:
        from axcore.platform import peer_watch

        host = settings.coordinator_address.rsplit(":", 1)[0] if settings.coordinator_address else None
        peer_watch.start(jax.process_index(), jax.process_count(), host)


def is_primary() -> bool:
    """Whether this is process 0, the one that writes configs, metrics and progress."""
    return jax.process_index() == 0


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-able `value`, in process order (a collective: all processes call it).

    One process: `[value]`. Several: the JSON texts' lengths, then the padded UTF-8 bytes,
    through `multihost_utils.process_allgather`.
    """
    text = json.dumps(value, sort_keys=True).encode()
    if jax.process_count() == 1:
        return [json.loads(text)]
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.int64(len(text)))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(text)] = np.frombuffer(text, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(gathered, lengths)]


def place_batch(batch: Any, sharding: jax.sharding.Sharding) -> Any:
    """The global host batch (a tree of `[global_batch, ...]` arrays) as global arrays on `sharding`.

    With one process this is `jax.device_put`. With several, every process holds the same
    global batch and gives each of its own devices only the rows (and slices) it holds.
    Training and evaluation do not use it: each process builds only its own rows
    (`axcore.data.device_loader.DeviceLoader`). It places small host arrays every process
    holds whole.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(batch, sharding)

    def place(array):
        array = np.asarray(array)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    return jax.tree.map(place, batch)


__all__ = [
    "DistributedError",
    "allgather_json",
    "coordinator_bind_address",
    "DistributedSettings",
    "distributed_settings",
    "initialize_distributed",
    "is_primary",
    "place_batch",
]
