"""The `tensorstore` checkpoint backend: one zarr3 array per leaf, written with tensorstore.

Layout of one step::

    <directory>/step_00000100/
        arrays/<name>/          one zarr3 array per leaf; <name> is the sanitized tree
                                path (`opt.0.mu.w` for `['opt'][0].mu['w']`)
        index.json              format, step, metadata and its CRC32, and per leaf
                                path/name/shape/dtype and the CRC32 of every piece written
        COMMITTED               written last (temp file + os.replace), with the CRC32 of
                                index.json; only steps with it count

`save` copies every addressable shard whose `replica_id` is 0 to host memory before
it returns (so the caller may donate or delete the arrays), then a background thread
writes each copy into its region of the leaf's array; chunks are the saved
sharding's shards (split further above 64 MiB), so no two processes write one chunk.
With several processes, each writes only its own shards and then `done.<process>`
(holding its shards' checksums); process 0 waits for all of them, writes `index.json`
and `COMMITTED`, and prunes old steps. The checksums are CRC32s of the host copies
being written, computed in the background write thread (never on the training
thread, and from the one copy the write needs anyway), each process for its own
shards. A step that failed verification can be renamed out of the way with
`set_aside` (see `_aside`). `restore` reads, for each leaf, only the slices
the target sharding places on this process's devices, and verifies index.json, the
metadata and every saved piece it read (see `verify`), plus each array's zarr.json
dtype and shape; any failure is a one-line CheckpointError naming the file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from axcore.checkpoint import _aside, _tree, verify
from axcore.checkpoint.base import CheckpointError, PyTree

log = logging.getLogger(__name__)

_FORMAT = "axcore.tensorstore/1"
COMMIT_MARKER = "COMMITTED"
INDEX_FILE = "index.json"
ARRAYS_DIR = "arrays"
_STEP_DIR = re.compile(r"step_(\d{8,})")
# Largest chunk written; bigger shards are split (along dimensions that halve evenly).
_MAX_CHUNK_BYTES = 64 << 20
_Index = tuple[tuple[int, int], ...]  # (start, stop) per dimension.


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class _Leaf:
    """One leaf being saved: where it goes and this process's host copies of it."""

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk: tuple[int, ...]
    pieces: list[tuple[_Index, np.ndarray]] = field(default_factory=list)

    def entry(self, checksums: list[dict]) -> dict:
        return {
            "path": self.path,
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype.name,
            "pieces": checksums,
        }


class TensorStoreBackend:
    """Checkpoints as zarr3 arrays written with tensorstore (see module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last_n: int | None = 3,
        async_save: bool = True,
        commit_timeout_s: float = 1800.0,
    ):
        # Absolute path of the checkpoint directory (created if missing).
        self.directory = os.path.abspath(os.fspath(directory))
        # How many committed steps to keep (oldest deleted first); None keeps all.
        self.keep_last_n = _tree.check_keep_last_n(keep_last_n)
        # Whether `save` returns before the write finishes.
        self.async_save = bool(async_save)
        # With several processes: how long to wait for the others' shards / the commit.
        self.commit_timeout_s = commit_timeout_s
        os.makedirs(self.directory, exist_ok=True)
        self._context = ts.Context()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="axcore-ckpt")
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, metadata: dict) -> None:
        step = _tree.check_step(step)
        where = f"step {step} in {self.directory}"
        _tree.check_state(state, where)
        metadata = _tree.json_copy(metadata, where)
        self.wait()  # At most one save in flight; surfaces the previous save's error.
        if step in self.all_steps():
            log.warning("Checkpoint step %d already exists in %s; not saving it again.", step, self.directory)
            return
        leaves = _snapshot(state)  # Synchronous: afterwards the caller may donate or delete the arrays.
        empty = [e for e in _tree.index_of(state) if "empty" in e]  # None, optax.EmptyState(), ...
        step_dir = os.path.join(self.directory, step_dir_name(step))
        if jax.process_index() == 0 and os.path.exists(step_dir):
            log.warning("Removing %s, left over from an interrupted save.", step_dir)
            shutil.rmtree(step_dir)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"axcore_tensorstore_save_{step}")
        if self.async_save:
            self._pending = (step, self._executor.submit(self._write, step, step_dir, leaves, empty, metadata))
        else:
            self._finish(step, lambda: self._write(step, step_dir, leaves, empty, metadata))

    def wait(self) -> None:
        if self._pending is not None:
            (step, future), self._pending = self._pending, None
            self._finish(step, future.result)

    def _finish(self, step: int, run: Any) -> None:
        try:
            run()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"Saving step {step} in {self.directory} failed: {type(e).__name__}: {e}. The step "
                f"is not committed; check free space and permissions."
            ) from e

    def _write(self, step: int, step_dir: str, leaves: list[_Leaf], empty: list[dict], metadata: dict) -> None:
        arrays_dir = os.path.join(step_dir, ARRAYS_DIR)
        opening = [
            ts.open(_spec(os.path.join(arrays_dir, leaf.name), leaf), create=True, open=True, context=self._context)
            for leaf in leaves
        ]
        writes = []
        for leaf, future in zip(leaves, opening):
            store = future.result()
            writes += [store[_slices(index)].write(data) for index, data in leaf.pieces if data.size]
        checksums = {leaf.path: [verify.piece(i, d) for i, d in leaf.pieces if d.size] for leaf in leaves}
        for w in writes:
            w.result()
        pid, nproc = jax.process_index(), jax.process_count()
        if nproc > 1:
            _atomic_write(os.path.join(step_dir, f"done.{pid}"), json.dumps(checksums))
        if pid != 0:
            self._await(os.path.join(step_dir, COMMIT_MARKER), f"process 0 to commit step {step}")
            return
        for other in range(1, nproc):
            done = os.path.join(step_dir, f"done.{other}")
            self._await(done, f"process {other} to write its shards of step {step}")
            with open(done) as f:
                for path, pieces in json.load(f).items():
                    checksums[path] += pieces
        arrays = [leaf.entry(checksums[leaf.path]) for leaf in leaves]
        index = {
            "format": _FORMAT,
            "step": step,
            "metadata": metadata,
            "metadata_crc32": verify.json_checksum(metadata),
            "arrays": arrays,
            "empty": empty,
        }
        text = json.dumps(index, indent=1)
        _atomic_write(os.path.join(step_dir, INDEX_FILE), text)
        commit = {"step": step, "time": time.time(), "index_crc32": zlib.crc32(text.encode())}
        _atomic_write(os.path.join(step_dir, COMMIT_MARKER), json.dumps(commit))
        self._prune()

    def _await(self, path: str, what: str) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise CheckpointError(f"Timed out after {self.commit_timeout_s:.0f} s waiting for {what} ({path}).")
            time.sleep(0.05)

    def _prune(self) -> None:
        if self.keep_last_n is None:
            return
        for old in self.all_steps()[: -self.keep_last_n]:
            old_dir = os.path.join(self.directory, step_dir_name(old))
            os.remove(os.path.join(old_dir, COMMIT_MARKER))  # Uncommit first: never half-deleted yet valid.
            shutil.rmtree(old_dir, ignore_errors=True)

    # -- listing --------------------------------------------------------------------------

    @staticmethod
    def step_of(name: str) -> int | None:
        """The step of a step directory's name (`step_00000200`, see `step_dir_name`), None for any other name."""
        match = _STEP_DIR.fullmatch(name)
        return int(match.group(1)) if match else None

    def all_steps(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        committed = [n for n in names if os.path.exists(os.path.join(self.directory, n, COMMIT_MARKER))]
        return sorted(s for s in map(self.step_of, committed) if s is not None)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def incomplete_steps(self) -> list[int]:
        """Steps with a directory but no commit marker (interrupted saves, or one in flight)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        open_ = [n for n in names if not os.path.exists(os.path.join(self.directory, n, COMMIT_MARKER))]
        return sorted(s for s in map(self.step_of, open_) if s is not None)

    def discard_incomplete(self, step: int) -> None:
        """Deletes `step`'s directory, which has no commit marker (e.g. left by pruning a kill interrupted).

        Raises:
            CheckpointError: the step is committed (nothing is deleted), or the directory cannot be deleted.
        """
        if os.path.exists(os.path.join(self.directory, step_dir_name(step), COMMIT_MARKER)):
            raise CheckpointError(f"Checkpoint step {step} in {self.directory} is committed; not discarding it.")
        _aside.discard(self.directory, step_dir_name(step))

    def set_aside(self, step: int) -> str:
        """Renames committed `step` out of the way (see `_aside.move_aside`); returns its new path.

        `step_<8 digits>.corrupt-<time>` is not a step name, so the step is no longer
        listed, restored or pruned, and can be saved again. With several processes
        every process calls this (process 0 renames). Raises CheckpointError if the
        step cannot be renamed.
        """
        self.wait()
        return _aside.move_aside(self.directory, step_dir_name(step))

    # -- restoring ------------------------------------------------------------------------

    def restore(self, target: PyTree, step: int | None = None, *, partial: bool = False) -> tuple[PyTree, dict]:
        step = _tree.resolve_step(step, self.all_steps(), self.directory)
        where = f"step {step} in {self.directory}"
        step_dir = os.path.join(self.directory, step_dir_name(step))
        index = self._read_index(step, step_dir, where)
        entries = {e["path"]: e for e in index["arrays"]}
        abstract = _tree.abstract_target(target)
        _tree.check_matches(index["arrays"] + index["empty"], abstract, where, partial=partial)
        verify.verify_metadata(index["metadata"], index.get("metadata_crc32"), where, INDEX_FILE)
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        leaves = [entries[jax.tree_util.keystr(p)] for p, _ in flat]
        opening = [
            ts.open(_spec(os.path.join(step_dir, ARRAYS_DIR, e["name"])), open=True, read=True, context=self._context)
            for e in leaves
        ]
        reads: list[tuple[Any, dict[_Index, Any]]] = []
        for (_, sds), entry, future in zip(flat, leaves, opening):
            with self._reading(where, entry):
                store = future.result()
            got = (np.dtype(store.dtype.numpy_dtype).name, list(store.shape))
            if got != (entry["dtype"], entry["shape"]):
                file = f"{ARRAYS_DIR}/{entry['name']}/zarr.json"
                why = (
                    f"{entry['path']} in {file} is {got[0]}[{','.join(map(str, got[1]))}], "
                    f"but {INDEX_FILE} recorded {_tree._describe(entry)}"
                )
                raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why)
            wanted = {_normalize(idx, sds.shape) for idx in sds.sharding.addressable_devices_indices_map(sds.shape).values()}
            reads.append((store, {index: store[_slices(index)].read() for index in wanted}))
        data: list[dict[_Index, np.ndarray]] = []
        for entry, (store, pending) in zip(leaves, reads):
            with self._reading(where, entry):
                got = {index: r.result() for index, r in pending.items()}
                verify.verify_pieces(
                    entry["path"],
                    entry.get("pieces", ()),
                    list(got.items()),
                    where,
                    f"{ARRAYS_DIR}/{entry['name']}",
                    read=lambda index, store=store: store[_slices(index)].read().result(),
                )
            data.append(got)
        arrays = [
            jax.make_array_from_callback(sds.shape, sds.sharding, lambda idx, r=r, s=sds.shape: r[_normalize(idx, s)])
            for (_, sds), r in zip(flat, data)
        ]
        return jax.tree_util.tree_unflatten(treedef, arrays), index["metadata"]

    def _read_index(self, step: int, step_dir: str, where: str) -> dict:
        """index.json, checked against the CRC32 in the commit marker (when it has one)."""
        try:
            with open(os.path.join(step_dir, COMMIT_MARKER)) as f:
                expected = json.loads(f.read() or "{}").get("index_crc32")
            with open(os.path.join(step_dir, INDEX_FILE), "rb") as f:
                raw = f.read()
            if expected is not None and zlib.crc32(raw) != expected:
                raise ValueError("it does not match the checksum in " + COMMIT_MARKER)
            index = json.loads(raw)
            for e in index["arrays"]:
                e["path"], e["name"], e["shape"], e["dtype"]  # All present
                if not isinstance(e["name"], str) or not _SAFE_NAME.fullmatch(e["name"]):
                    raise ValueError(f"array name {e['name']!r} is not one this backend writes (it could escape {ARRAYS_DIR}/)")
            index["empty"], index["metadata"]
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = verify.cause(e)
            raise CheckpointError(
                f"Checkpoint {where} is marked committed but its {INDEX_FILE} is unreadable ({why}); "
                f"delete {step_dir} to fall back to the previous step.",
                reason=f"{INDEX_FILE} is unreadable: {why}",
            ) from None
        return index

    @contextlib.contextmanager
    def _reading(self, where: str, entry: dict):
        """Turns a storage error while reading `entry` into a one-line CheckpointError."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            why = f"{entry['path']} ({ARRAYS_DIR}/{entry['name']}) cannot be read: {verify.cause(e)}"
            raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why) from None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> TensorStoreBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorStoreBackend({self.directory!r}, keep_last_n={self.keep_last_n})"


# -- helpers ------------------------------------------------------------------------------


def _snapshot(state: PyTree) -> list[_Leaf]:
    """Host views of this process's replica-0 shards of every leaf, with names.

    Off-CPU, `np.asarray` is a host copy. On CPU it is a zero-copy view of the device
    buffer: while the view lives (until the background write ends), XLA will not
    reuse that buffer for a donating computation and allocates a fresh output
    instead, so the saved values stay intact without a blocking copy.
    """
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays = [leaf for _, leaf in flat if isinstance(leaf, jax.Array)]
    for x in arrays:  # Start all device-to-host transfers before waiting on any.
        for shard in x.addressable_shards:
            if shard.replica_id == 0 and shard.device.platform != "cpu":
                shard.data.copy_to_host_async()
    leaves, used = [], set()
    for path, x in flat:
        name = unique_array_name(path, used)
        if isinstance(x, jax.Array):
            shape, dtype = tuple(x.shape), np.dtype(x.dtype)
            chunk = chunk_shape(tuple(x.sharding.shard_shape(x.shape)), dtype.itemsize)
            pieces = [
                (_normalize(s.index, shape), np.asarray(s.data))
                for s in x.addressable_shards
                if s.replica_id == 0
            ]
        else:  # numpy arrays and Python scalars: written by process 0.
            value = np.array(x)
            shape, dtype = value.shape, value.dtype
            chunk = chunk_shape(shape, dtype.itemsize)
            pieces = [(_normalize((), shape), value)] if jax.process_index() == 0 else []
        leaves.append(_Leaf(jax.tree_util.keystr(path), name, shape, dtype, chunk, pieces))
    return leaves


# The array names `unique_array_name` makes (dot-joined sanitized keys): never a path separator or "..".
_SAFE_NAME = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*(-[0-9]+)?")


def unique_array_name(path: tuple, used: set[str]) -> str:
    """A file-system-safe, unique array name from a tree path."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):  # DictKey/FlattenedIndexKey, SequenceKey, GetAttrKey.
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(re.sub(r"[^A-Za-z0-9_\-]+", "_", str(key)) or "_")
    name = ".".join(parts) or "root"
    if len(name) > 150:
        name = name[:120] + "-" + hashlib.sha1(name.encode()).hexdigest()[:12]
    base, n = name, 1
    while name in used:
        n += 1
        name = f"{base}-{n}"
    used.add(name)
    return name


def chunk_shape(shard_shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    chunk = [max(1, d) for d in shard_shape]
    while int(np.prod(chunk)) * itemsize > _MAX_CHUNK_BYTES:
        even = [i for i, d in enumerate(chunk) if d % 2 == 0]
        if not even:
            break
        i = max(even, key=lambda j: chunk[j])
        chunk[i] //= 2
    return tuple(chunk)


def _normalize(index: tuple, shape: tuple[int, ...]) -> _Index:
    """`(start, stop)` per dimension for a tuple of slices (missing trailing ones = all)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def _slices(index: _Index) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


def _spec(path: str, leaf: _Leaf | None = None) -> dict:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
    if leaf is not None:
        spec["metadata"] = {
            "shape": list(leaf.shape),
            "data_type": leaf.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(leaf.chunk)}},
        }
    return spec


def _atomic_write(path: str, text: str) -> None:
    """Writes `text` to `path` through a temp file and os.replace, fsyncing both."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
