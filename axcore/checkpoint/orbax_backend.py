"""The `orbax` checkpoint backend: orbax-checkpoint's CheckpointManager.

Layout: `<directory>/<step>/` holds three items, `state` (the arrays, written by
orbax's PyTree handler: OCDBT, zarr, uncompressed unless `compress=True`), `meta`
(JSON: the caller's metadata plus the tree index used to report mismatches) and
`checksums` (one JSON file per process, see `_orbax_checksums`), and orbax's
`commit_success.txt`. Saves use orbax's commit-file atomicity, so a step counts only once that marker exists; an
interrupted save leaves a directory without it, which is ignored and replaced when
that step is saved again. Nothing is pickled.

`meta` also holds the CRC32 of the metadata; the `checksums` item holds the `mix32`
of every replica-0 shard of every array, computed on the device from the arrays
themselves (no extra device-to-host copy, nothing on the training thread but one
dispatch per device; see `_orbax_checksums` for why) by every process for the shards
it holds. Both are part of the step, so written before the commit file. Steps saved
before the `checksums` item existed carry CRC32s in `meta["checksums"]` (process 0's
shards only) and are verified as before. `restore` verifies the metadata and every
recorded shard contained in what this process restored; any failure, or an
orbax/TensorStore error, is a one-line CheckpointError naming the step and the item
or parameter path. While the trainer routes orbax's own reports to the run's log file
(`_save_log`), a failed save's line ends with that file's path.

`set_aside(step)` renames a committed step that failed verification to
`<step>.corrupt-<UTC time>` (see `_aside`) and reloads the manager's step list, so
neither orbax nor this backend lists it any more (nor counts it for `keep_last_n`),
and the step can be saved afresh.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import options as ocp_options
from orbax.checkpoint.path import atomicity as ocp_atomicity

from axcore.checkpoint import _aside, _orbax_checksums, _save_log, _tree, verify
from axcore.checkpoint.base import CheckpointError, PyTree

log = logging.getLogger(__name__)

# The format written: /2 keeps the arrays' checksums in the `checksums` item. /1 steps (CRC32s in
# `meta`) still restore; an axcore that knows only /1 refuses a /2 step instead of restoring
# it unverified.
_FORMAT = "axcore.orbax/2"
_READABLE = ("axcore.orbax/1", _FORMAT)
_STATE, _META = "state", "meta"


class OrbaxBackend:
    """Checkpoints through `orbax.checkpoint.CheckpointManager` (see module docstring)."""

    def __init__(
        self, directory: str | os.PathLike, *, keep_last_n: int | None = 3, async_save: bool = True, compress: bool = False
    ):
        # Absolute path of the checkpoint directory (created if missing).
        self.directory = os.path.abspath(os.fspath(directory))
        # How many committed steps to keep (oldest deleted first); None keeps all.
        self.keep_last_n = _tree.check_keep_last_n(keep_last_n)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep_last_n,
            enable_async_checkpointing=bool(async_save),
            create=True,
            # Write in place and mark completion with commit_success.txt (the default on
            # local disks renames a tmp directory instead and counts any plain `<step>/`).
            atomicity_options=ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.COMMIT_FILE),
        )
        # zstd on the arrays; off by default: float train state hardly compresses, and
        # compressing made saves ~2.5x slower (benchmarks/checkpoint_io.py). Restore reads
        # either kind, since the codec is recorded per array.
        self.compress = bool(compress)
        handlers = {
            _STATE: ocp.PyTreeCheckpointHandler(use_compression=self.compress),
            _META: ocp.JsonCheckpointHandler(),
            _orbax_checksums.ITEM: _orbax_checksums.ChecksumsHandler(),
        }
        _orbax_checksums.register()
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._async = bool(async_save)
        self._saving: int | None = None
        self._closed = False

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, metadata: dict) -> None:
        step = _tree.check_step(step)
        where = f"step {step} in {self.directory}"
        _tree.check_state(state, where)
        metadata = _tree.json_copy(metadata, where)
        self.wait()  # At most one save in flight; surfaces the previous save's error.
        if step in self._manager.all_steps():
            log.warning("Checkpoint step %d already exists in %s; not saving it again.", step, self.directory)
            return
        # Computed on the device, fetched and written by the checksums item in orbax's commit
        # thread. Dispatched after orbax's (async) save call, not during its host copy (see
        # _orbax_checksums); a synchronous save call writes the item itself, so before it.
        pending = verify.PendingChecksums(state)
        if not self._async:
            _dispatch(pending, where)
        meta = {
            "format": _FORMAT,
            "metadata": metadata,
            "metadata_crc32": verify.json_checksum(metadata),
            "index": _tree.index_of(state),
            # Where the arrays' checksums are: one file per process in this item.
            "checksums_item": {"name": _orbax_checksums.ITEM, "processes": jax.process_count()},
        }
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.PyTreeSave(state),
                _META: ocp.args.JsonSave(meta),
                _orbax_checksums.ITEM: _orbax_checksums.ChecksumsSave(pending),
            }
        )
        self._saving = step
        try:
            # force=True: also save a step below the latest (e.g. after restoring an older one).
            self._manager.save(step, args=args, force=True)
        except BaseException as e:
            pending.abandon(e)
            self._saving = None
            if not isinstance(e, Exception):
                raise
            raise CheckpointError(f"Saving {where} failed: {type(e).__name__}: {e}{_save_log.report_hint()}") from e
        _dispatch(pending, where)  # Before returning: a donating step dispatched later runs after it.

    def wait(self) -> None:
        step, self._saving = self._saving, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(
                f"Saving step {step} in {self.directory} failed: {type(e).__name__}: {e}. "
                f"The step is not committed; check free space and permissions{_save_log.report_hint()}."
            ) from e

    # -- listing --------------------------------------------------------------------------

    @staticmethod
    def step_of(name: str) -> int | None:
        """The step of a step directory's name (orbax names it by the step's digits), None for any other name."""
        return int(name) if name.isdigit() else None

    def all_steps(self) -> list[int]:
        # orbax lists a step as soon as its save starts; only count finalized ones.
        return sorted(s for s in self._manager.all_steps() if self._is_committed(s))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def incomplete_steps(self) -> list[int]:
        """Step directories without orbax's commit file (interrupted saves, or one in flight)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        steps = [self.step_of(n) for n in names]
        return sorted(s for s in steps if s is not None and not self._is_committed(s))

    def discard_incomplete(self, step: int) -> None:
        """Deletes `step`'s directory, which has no commit marker (e.g. left by pruning a kill interrupted).

        Raises:
            CheckpointError: the step is committed (nothing is deleted), or the directory cannot be deleted.
        """
        if self._is_committed(step):
            raise CheckpointError(f"Checkpoint step {step} in {self.directory} is committed; not discarding it.")
        _aside.discard(self.directory, str(step))

    def _is_committed(self, step: int) -> bool:
        return os.path.exists(os.path.join(self.directory, str(step), ocp_atomicity.COMMIT_SUCCESS_FILE))

    def set_aside(self, step: int) -> str:
        """Renames committed `step` out of the way (see `_aside.move_aside`); returns its new path.

        Afterwards neither this backend nor orbax lists the step (the manager's cached
        step list is reloaded), so `keep_last_n` never counts or deletes it and the
        step can be saved again. With several processes every process calls this
        (process 0 renames). Raises CheckpointError if the step cannot be renamed.
        """
        self.wait()
        try:
            return _aside.move_aside(self.directory, str(step))
        finally:
            self._manager.reload()

    # -- restoring ------------------------------------------------------------------------

    def restore(self, target: PyTree, step: int | None = None, *, partial: bool = False) -> tuple[PyTree, dict]:
        step = _tree.resolve_step(step, self.all_steps(), self.directory)
        where = f"step {step} in {self.directory}"
        meta_file = f"{step}/{_META}/metadata"
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        except Exception as e:
            why = f"{meta_file} is unreadable: {verify.cause(e)}"
            raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why) from None
        found = meta.get("format") if isinstance(meta, dict) else None
        if isinstance(found, str) and found.startswith("axcore.orbax/") and found not in _READABLE:
            why = f"{meta_file} has format {found!r}, newer than this axcore reads ({', '.join(_READABLE)})"
            raise CheckpointError(f"Checkpoint {where} was written by a newer axcore: {why}; upgrade axcore.", reason=why)
        if found not in _READABLE or not isinstance(meta.get("index"), list):
            why = f"{meta_file} is not an axcore orbax index"
            raise CheckpointError(
                f"Checkpoint {where} was not written by axcore's orbax backend (no '{_META}' index).", reason=why
            )
        abstract = _tree.abstract_target(target)
        try:
            _tree.check_matches(meta["index"], abstract, where, partial=partial)
        except (KeyError, TypeError, AttributeError) as e:
            why = f"{meta_file} has a malformed index ({verify.cause(e)})"
            raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why) from None
        verify.verify_metadata(meta.get("metadata"), meta.get("metadata_crc32"), where, meta_file)
        try:
            restore_args = jax.tree.map(lambda leaf: ocp.ArrayRestoreArgs(sharding=leaf.sharding), abstract)
            # partial_restore: orbax reads only the target's leaves (the rest is never deserialized).
            args = ocp.args.PyTreeRestore(abstract, restore_args=restore_args, partial_restore=partial)
            restored = self._manager.restore(step, args=ocp.args.Composite(**{_STATE: args}))[_STATE]
        except Exception as e:  # E.g. a missing or truncated data file, or a differing container type.
            _quiet_orbax_leftovers()
            why = f"{step}/{_STATE} cannot be read: {verify.cause(e)}"
            raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why) from None
        checksums = meta.get("checksums") or _read_checksums(meta, self.directory, step, where)
        for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]:
            path = jax.tree_util.keystr(path)
            if not isinstance(x, jax.Array):
                x = jax.numpy.asarray(x)
            regions = verify.host_regions(x)
            if x.dtype.name != _index_dtype(meta["index"], path):
                why = f"{path} in {step}/{_STATE} was restored as {x.dtype.name}, not the saved dtype"
                raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why)
            verify.verify_pieces(path, checksums.get(path, ()), regions, where, f"{step}/{_STATE}")
        return restored, meta["metadata"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> OrbaxBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OrbaxBackend({self.directory!r}, keep_last_n={self.keep_last_n}, compress={self.compress})"


def _dispatch(pending: verify.PendingChecksums, where: str) -> None:
    try:
        pending.dispatch()
    except Exception as e:  # An async save then fails to commit; wait() says so again.
        raise CheckpointError(f"Checksumming {where} failed: {type(e).__name__}: {e}") from e


def _read_checksums(meta: dict, directory: str, step: int, where: str) -> dict:
    """The `checksums` item's pieces of every process (none for a step saved without it)."""
    item = meta.get("checksums_item")
    if not item:
        return {}
    try:
        name, processes = str(item["name"]), int(item["processes"])
        if name != _orbax_checksums.ITEM:
            raise ValueError(f"unknown checksums item {name!r}")
    except (KeyError, TypeError, ValueError) as e:
        why = f"{step}/{_META}/metadata has a malformed checksums entry ({verify.cause(e)})"
        raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why) from None
    try:
        return _orbax_checksums.read(os.path.join(directory, str(step), name), processes)
    except CheckpointError as e:
        why = f"{step}/{e.reason}"
        raise CheckpointError(f"Checkpoint {where} failed verification: {why}.", reason=why) from None


def _index_dtype(index: list[dict], path: str) -> str | None:
    for e in index:
        if e.get("path") == path:
            return e.get("dtype")
    return None


_quieted = False


def _quiet_orbax_leftovers() -> None:
    """Keeps a failed orbax read's leftovers from printing tracebacks later.

    When one array read fails, orbax abandons the other read coroutines and TensorStore
    callbacks, which then fail at garbage collection ("Event loop is closed", coroutine
    GeneratorExit) and would print "Exception ignored in ..." tracebacks to stderr. The
    filter drops only those; anything else goes to the previous hook.
    """
    global _quieted
    if not _quieted:
        _quieted = True
        previous = sys.unraisablehook

        def hook(unraisable):
            code = getattr(unraisable.object, "cr_code", None)
            if "Event loop is closed" in str(unraisable.exc_value) or (
                code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
            ):
                return
            previous(unraisable)

        sys.unraisablehook = hook
    gc.collect()
