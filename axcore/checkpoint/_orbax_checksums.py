"""The `checksums` item of an orbax step: every process's shard checksums, before the commit.

Layout: `<step>/checksums/process_<i>.json`, one per process, each
`{"format": "axcore.orbax.checksums/1", "process": i, "pieces": {path: [piece, ...]}}`
with the `verify` pieces of the replica-0 shards process i holds (NumPy leaves:
process 0). Restore reads every process's file (`read`), so each process verifies
whatever it restores, also shards another process saved.

Why this shape (orbax 0.12.8, checked in its sources):

- `PyTreeCheckpointHandler.async_save` copies the arrays to host memory inside the
  save call (`replica_slices.transfer_arrays_to_host`, blocking until the copy exists)
  and writes them from a background thread; the host copies are not reachable through
  a public API. Checksumming our own host copy would mean a second blocking
  device-to-host copy of the whole state per save (what this backend did before).
- The storage layer cannot checksum the data for us either: the arrays are zarr v2
  (orbax's default, no checksum codec at all), and with `use_zarr3` the codec chain
  orbax builds (`tensorstore_utils._build_zarr3_metadata`) has a crc32c codec only for
  the shard index, none for the data chunks; neither is an option.
- So the checksums are computed on the device (`verify.PendingChecksums`: one jitted
  call per local device for all its shards, dispatched before `save` returns, so a
  donating step that follows runs after it has read the buffers), and this item's
  commit future fetches the few resulting words in orbax's background commit thread
  (`_WriteWhenAwaited`, no thread of its own) and writes them. orbax writes the
  commit marker only after every item's commit futures of every process have
  finished (`async_checkpointer._background_wait_for_commit_futures`, then a barrier,
  then `finalize`), so a committed step always has its checksums.
- When to dispatch (measured on this 2-core CPU machine, 1.3 GB state, 295 leaves):
  before orbax's save call, the computation shares the cores with orbax's blocking
  Python work and made it 3-5x slower; from this item's `async_save` (inside orbax's
  call) about 2x slower; right after orbax's call returns, the dispatch itself costs
  ~0.5 ms when idle but 2-25 ms when orbax's just-started background threads hold
  the GIL. The last is the least, so the backend dispatches there. The first
  dispatch compiles the program (~1-1.5 s for 295 leaves, once per tree shape).
- Each process writes only its own file: nothing is computed and then thrown away,
  and no process waits for another's checksums (orbax's barrier does that).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from axcore.checkpoint import verify
from axcore.checkpoint.base import CheckpointError

ITEM = "checksums"
_FORMAT = "axcore.orbax.checksums/1"
# How long the commit thread waits for orbax to create the item directory.
_DIRECTORY_TIMEOUT_S = 600.0


def file_name(process: int) -> str:
    return f"process_{process}.json"


class ChecksumsHandler(ocp.AsyncCheckpointHandler):
    """Writes this process's `verify.PendingChecksums` once the device has them."""

    async def async_save(self, directory: Any, args: ChecksumsSave) -> list[Any]:
        return [_WriteWhenAwaited(directory, args.pending)]

    def save(self, directory: Any, args: ChecksumsSave) -> None:
        _write(directory, args.pending)

    def restore(self, directory: Any, args: ChecksumsRestore | None = None) -> dict[str, list[dict]]:
        return read(os.fspath(directory), args.processes if args is not None else 1)


class _WriteWhenAwaited:
    """A commit future (orbax's `Future` protocol) that writes the file when awaited.

    orbax awaits every commit future of a save in its background commit thread (the
    training thread's `save` only collects them), so the fetch and write run there,
    without the thread orbax's own futures start per item (about a millisecond of the
    training thread's time each). Item directories are created asynchronously by a
    future that orbax awaits earlier; the write still waits for the directory to exist.
    """

    def __init__(self, directory: Any, pending: verify.PendingChecksums):
        self._directory = os.fspath(directory)
        self._pending = pending
        self._lock = threading.Lock()
        self._outcome: tuple[bool, BaseException | None] | None = None

    def result(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._outcome is None:
                try:
                    _await_directory(self._directory, _DIRECTORY_TIMEOUT_S if timeout is None else timeout)
                    _write(self._directory, self._pending)
                    self._outcome = (True, None)
                except BaseException as e:  # Raised again to every caller, as a future does.
                    self._outcome = (False, e)
        ok, error = self._outcome
        if not ok:
            raise error

    def cancel(self) -> bool:
        return False


def _await_directory(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not created within {timeout_s:.0f} s")
        time.sleep(0.01)


@dataclasses.dataclass
class ChecksumsSave(ocp.args.CheckpointArgs):
    """Save argument: the checksums being computed (dispatched by the backend's `save`)."""

    pending: verify.PendingChecksums


@dataclasses.dataclass
class ChecksumsRestore(ocp.args.CheckpointArgs):
    """Restore argument: how many processes wrote the step."""

    processes: int = 1


def register() -> None:
    """Tells orbax which handler the two argument types belong to (idempotent)."""
    ocp.args.register_with_handler(ChecksumsHandler, for_save=True)(ChecksumsSave)
    ocp.args.register_with_handler(ChecksumsHandler, for_restore=True)(ChecksumsRestore)


def _write(directory: Any, pending: verify.PendingChecksums) -> None:
    pieces = pending.result()  # Waits for the device's few words, not on the training thread.
    process = jax.process_index()
    record = {"format": _FORMAT, "process": process, "pieces": pieces}
    with open(os.path.join(os.fspath(directory), file_name(process)), "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def read(item_dir: str, processes: int) -> dict[str, list[dict]]:
    """Every process's pieces of the step whose `checksums` item is `item_dir`, merged per path.

    Raises:
        CheckpointError: a process's file is missing or not one this module writes
            (`reason` names the file; the caller adds the step).
    """
    merged: dict[str, list[dict]] = {}
    for process in range(processes):
        name = f"{ITEM}/{file_name(process)}"
        try:
            with open(os.path.join(item_dir, file_name(process))) as f:
                record = json.load(f)
            if record.get("format") != _FORMAT or not isinstance(record.get("pieces"), dict):
                raise ValueError("not an axcore checksums file")
            for path, pieces in record["pieces"].items():
                merged.setdefault(path, []).extend(pieces)
        except (OSError, ValueError, AttributeError) as e:
            why = f"{name} is unreadable ({verify.cause(e)})"
            raise CheckpointError(why, reason=why) from None
    return merged
