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

import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from axcore.errors import AxcoreError

PyTree = Any


class CheckpointError(AxcoreError):
    """A checkpoint cannot be saved or restored (the message names directory and step).

    `reason` is a short form of the message (no directory), used when reporting a
    step that is skipped in favour of an earlier one.
    """

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


class CheckpointMismatchError(CheckpointError):
    """The restore target's tree paths, shapes or dtypes differ from the checkpoint's."""


class CheckpointNotFoundError(CheckpointError):
    """The directory holds no committed checkpoint (or not the step asked for)."""


@runtime_checkable
class CheckpointBackend(Protocol):
    """What the trainer needs from a checkpoint backend.

    Factories registered through `axcore_register_checkpoint_backends` are called as
    `factory(directory, *, keep_last_n=3, async_save=True)` and return one of these.

    Optional, used by `restore_verified` where present: `incomplete_steps() -> list[int]`
    (step directories without a commit marker) and `set_aside(step) -> str` (renames a
    committed step that failed verification to a name that is no step, within the
    directory, so it is no longer listed, restored or pruned and can be saved again;
    returns the new path; with several processes every process calls it; raises
    CheckpointError if it cannot). Optional, used by the trainer when it starts:
    `discard_incomplete(step)` (deletes a step directory without a commit marker, such
    as an old step whose pruning a kill interrupted; raises CheckpointError for a
    committed step or when it cannot). Optional, used by run loading when a path names one
    step's directory (`axcore generate RUN/checkpoints/200`): `step_of(name) -> int | None`
    (the step a directory entry named `name` holds, `200` for orbax and `step_00000200`
    for tensorstore, None for any other name; the built-ins list their steps through it
    too, so the name is parsed in one place). Without it, a run is loaded by its
    directory and `--step`.
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

    def restore(self, target: PyTree, step: int | None = None, *, partial: bool = False) -> tuple[PyTree, dict]:
        """Reads `step` (default: the latest committed) into the target's shardings.

        Only committed steps count: call `wait()` first to include a pending save.

        Args:
            target: the state's tree with `jax.ShapeDtypeStruct` leaves (shape, dtype
                and `.sharding`); arrays are accepted too.
            step: the step to read; None for the latest committed one.
            partial: the target may leave out top-level entries of the saved tree,
                e.g. `{"params": ...}` of a saved train state: only the target's
                leaves are read (the others are never read, so neither their data
                nor their checksums are checked) and verified. Each entry the
                target names must match the saved one exactly. `restore_verified`
                passes the keyword only when True, so a backend written before it
                still serves full restores.

        Returns:
            `(state, metadata)`: state has the target's structure, each leaf placed
            with exactly the target leaf's sharding.

        Raises:
            CheckpointNotFoundError: no committed step (or not `step`) in the directory.
            CheckpointMismatchError: tree paths, shapes or dtypes differ (with
                `partial`: within the entries the target names); the message lists
                every offending path.
            CheckpointError: a file is missing, unreadable or fails its checksum (one
                line naming the step and the file or parameter path).
        """

    def close(self) -> None:
        """Waits for pending saves and releases resources."""


def restore_verified(
    backend: CheckpointBackend,
    target: PyTree,
    step: int | None = None,
    report: Callable[[str], None] = print,
    *,
    partial: bool = False,
    set_aside: bool = False,
) -> tuple[PyTree, dict, int]:
    """Restores `step`, or else the latest committed step that verifies.

    `partial=True` restores only the target's entries (`CheckpointBackend.restore`).

    With `step` given, restores exactly that step or raises its CheckpointError. With
    None, tries committed steps newest first; each one that fails verification, cannot
    be read or does not match the target is reported through `report` in one line
    naming the next step tried. Steps without a commit marker (interrupted saves)
    newer than the restored one are reported too.

    With `set_aside=True` (the trainer, which owns the directory and will save into
    it; never a reader such as evaluation) and a backend that has `set_aside(step)`,
    every newer step that failed verification (not one that merely belongs to
    another model) is moved aside once an older step has restored, and its line
    says where to (`...; moved it aside to checkpoints/60.corrupt-...; restoring step
    55.`): the step is kept for inspection, no longer listed, and saved afresh when
    training reaches it again. Nothing moves when no step verifies, so a run never
    silently starts over. With several processes all of them must call this alike
    (the backends' `set_aside` is collective).

    Returns:
        `(state, metadata, step)`.

    Raises:
        CheckpointNotFoundError: no committed step (or not `step`).
        CheckpointError: `step` fails, or no committed step verifies
            (CheckpointMismatchError when the newest step is another model's).
    """
    options = {"partial": True} if partial else {}  # A backend without partial restore keeps working.
    if step is not None:
        state, metadata = backend.restore(target, step, **options)
        return state, metadata, step
    steps = list(backend.all_steps())
    if not steps:
        state, metadata = backend.restore(target, **options)  # Raises CheckpointNotFoundError.
        return state, metadata, backend.latest_step()
    incomplete = getattr(backend, "incomplete_steps", lambda: [])()
    for s in sorted((s for s in incomplete if s > steps[-1]), reverse=True):
        report(f"Ignoring checkpoint step {s}: it has no commit marker (an interrupted save).")
    failed: list[tuple[int, CheckpointError]] = []  # Reported once the outcome is known.
    for s in reversed(steps):
        try:
            state, metadata = backend.restore(target, s, **options)
        except CheckpointNotFoundError:
            raise
        except CheckpointError as e:
            failed.append((s, e))
            continue
        for (bad, e), following in zip(failed, [f for f, _ in failed[1:]] + [s]):
            moved = _move_aside(backend, bad, e) if set_aside else ""
            why = _short(e.reason)
            report(f"Checkpoint step {bad} failed verification ({why}); {moved}restoring step {following}.")
        return state, metadata, s
    for (bad, e), following in zip(failed, [f for f, _ in failed[1:]]):
        report(f"Checkpoint step {bad} failed verification ({_short(e.reason)}); restoring step {following}.")
    newest = f"step {failed[0][0]}: {failed[0][1].reason}"
    # The newest step's kind of failure decides the error's type (another model's checkpoint: a mismatch).
    error_type = type(failed[0][1]) if isinstance(failed[0][1], CheckpointMismatchError) else CheckpointError
    raise error_type(
        f"No committed checkpoint in {getattr(backend, 'directory', 'the directory')} verifies ({_short(newest)}"
        + (f"; and {len(failed) - 1} older step(s) failed too" if len(failed) > 1 else "")
        + "); set trainer.checkpoint.restore_step=N to see one step's error, or start from a fresh directory.",
        reason=newest,
    )


def _move_aside(backend: CheckpointBackend, step: int, error: CheckpointError) -> str:
    """Moves a step that failed verification aside; the words for its report line."""
    move = getattr(backend, "set_aside", None)
    if move is None or isinstance(error, CheckpointMismatchError):
        return ""  # Another model's checkpoint is not damaged: left as it is.
    try:
        path = move(step)
    except CheckpointError as e:
        return f"could not move it aside ({_short(e.reason, 120)}); "
    directory = getattr(backend, "directory", None)
    shown = os.path.relpath(path, os.path.dirname(directory)) if directory else path
    return f"moved it aside to {shown}; "


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
