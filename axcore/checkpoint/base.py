"""The checkpoint backend protocol and its errors.

A backend saves a pytree of `jax.Array`s plus a JSON metadata dict per step into one
directory and restores it into whatever shardings the current run asks for. A step
counts only once its commit marker is written; a half-written step is invisible.

Example (any registered backend)::

    backend = registries.checkpoint_backends["orbax"]("/tmp/run/ckpt", keep_last_n=3)
    backend.save(100, state, {"data_position": 1234})   # May return before the write ends.
    backend.wait()                                      # Now step 100 is committed.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    state, metadata = backend.restore(abstract)         # The latest committed step.
    backend.close()

This module imports neither JAX nor a storage library, so that listing plugins stays
cheap.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from axcore.errors import AxcoreError

PyTree = Any


class CheckpointError(AxcoreError):
    """A checkpoint cannot be saved or restored (the message names directory and step)."""


class CheckpointMismatchError(CheckpointError):
    """The restore target's tree paths, shapes or dtypes differ from the checkpoint's."""


class CheckpointNotFoundError(CheckpointError):
    """The directory holds no committed checkpoint (or not the step asked for)."""


@runtime_checkable
class CheckpointBackend(Protocol):
    """What the trainer needs from a checkpoint backend.

    Factories registered through `axcore_register_checkpoint_backends` are called as
    `factory(directory, *, keep_last_n=3, async_save=True)` and return one of these.
    """

    def save(self, step: int, state: PyTree, metadata: dict) -> None:
        """Starts saving `state` (a pytree of arrays) and `metadata` (JSON-able) as `step`.

        May return before the write finishes; the arrays are snapshotted before it
        returns, so the caller may then donate or delete their buffers. A step that
        is already saved (or being saved) is skipped with a logged warning. Waits
        for the previous save first, so at most one save is in flight.

        Raises:
            CheckpointError: `metadata` is not JSON-serializable, a leaf is not an
                array, or the previous save failed.
        """

    def wait(self) -> None:
        """Blocks until every pending save is committed; raises a failed save's error."""

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""

    def all_steps(self) -> list[int]:
        """All committed steps, ascending."""

    def restore(self, target: PyTree, step: int | None = None) -> tuple[PyTree, dict]:
        """Reads `step` (default: the latest committed) into the target's shardings.

        Only committed steps count: call `wait()` first to include a pending save.

        Args:
            target: the state's tree with `jax.ShapeDtypeStruct` leaves (shape, dtype
                and `.sharding`); arrays are accepted too.
            step: the step to read; None for the latest committed one.

        Returns:
            `(state, metadata)`: state has the target's structure, each leaf placed
            with exactly the target leaf's sharding.

        Raises:
            CheckpointNotFoundError: no committed step (or not `step`) in the directory.
            CheckpointMismatchError: tree paths, shapes or dtypes differ; the message
                lists every offending path.
        """

    def close(self) -> None:
        """Waits for pending saves and releases resources."""
