"""The `orbax` checkpoint backend: orbax-checkpoint's CheckpointManager.

Layout: `<directory>/<step>/` holds two items, `state` (the arrays, written by
orbax's PyTree handler: OCDBT, zarr, uncompressed unless `compress=True`) and `meta`
(JSON: the caller's metadata plus the tree index used to report mismatches), and
orbax's `commit_success.txt`. Saves use orbax's commit-file atomicity, so a step counts only once that marker exists; an
interrupted save leaves a directory without it, which is ignored and replaced when
that step is saved again. Nothing is pickled.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import options as ocp_options
from orbax.checkpoint.path import atomicity as ocp_atomicity

from axcore.checkpoint import _tree
from axcore.checkpoint.base import CheckpointError, PyTree

log = logging.getLogger(__name__)

_FORMAT = "axcore.orbax/1"
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
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._saving: int | None = None
        self._closed = False

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, metadata: dict) -> None:
        step = _tree.check_step(step)
        where = f"step {step} in {self.directory}"
        _tree.check_state(state, where)
        meta = {"format": _FORMAT, "metadata": _tree.json_copy(metadata, where), "index": _tree.index_of(state)}
        self.wait()  # At most one save in flight; surfaces the previous save's error.
        if step in self._manager.all_steps():
            log.warning("Checkpoint step %d already exists in %s; not saving it again.", step, self.directory)
            return
        args = ocp.args.Composite(**{_STATE: ocp.args.PyTreeSave(state), _META: ocp.args.JsonSave(meta)})
        self._saving = step
        try:
            # force=True: also save a step below the latest (e.g. after restoring an older one).
            self._manager.save(step, args=args, force=True)
        except Exception as e:
            self._saving = None
            raise CheckpointError(f"Saving {where} failed: {type(e).__name__}: {e}") from e

    def wait(self) -> None:
        step, self._saving = self._saving, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(
                f"Saving step {step} in {self.directory} failed: {type(e).__name__}: {e}. "
                f"The step is not committed; check free space and permissions."
            ) from e

    # -- listing --------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        # orbax lists a step as soon as its save starts; only count finalized ones.
        return sorted(s for s in self._manager.all_steps() if self._is_committed(s))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _is_committed(self, step: int) -> bool:
        return os.path.exists(os.path.join(self.directory, str(step), ocp_atomicity.COMMIT_SUCCESS_FILE))

    # -- restoring ------------------------------------------------------------------------

    def restore(self, target: PyTree, step: int | None = None) -> tuple[PyTree, dict]:
        step = _tree.resolve_step(step, self.all_steps(), self.directory)
        where = f"step {step} in {self.directory}"
        meta = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise CheckpointError(f"Checkpoint {where} was not written by axcore's orbax backend (no '{_META}' index).")
        abstract = _tree.abstract_target(target)
        _tree.check_matches(meta["index"], abstract, where)
        try:
            restore_args = jax.tree.map(lambda leaf: ocp.ArrayRestoreArgs(sharding=leaf.sharding), abstract)
            args = ocp.args.PyTreeRestore(abstract, restore_args=restore_args)
            restored = self._manager.restore(step, args=ocp.args.Composite(**{_STATE: args}))
        except Exception as e:  # E.g. a container type that differs although every path matches.
            raise CheckpointError(f"Restoring {where} failed: {type(e).__name__}: {e}") from e
        return restored[_STATE], meta["metadata"]

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
