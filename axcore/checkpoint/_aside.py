"""Setting a damaged step aside: renamed within the checkpoint directory, kept for inspection.

`restore_verified` (with `set_aside=True`, as the trainer calls it) moves a committed
step that failed verification out of the way once an older step has restored, so
that training, when it reaches that step again, saves the fresh state instead of
skipping the save because the step "already exists". The step directory `<name>` is
renamed to `<name>.corrupt-<UTC time>` (`-2`, `-3`, ... appended if taken): a name
neither backend lists as a step (orbax counts only all-digit names, the tensorstore
backend only `step_<digits>`), so it is never restored, never counted or deleted by
`keep_last_n`, and keeps every file as it was.

With several processes every process calls `move_aside` for the same step (each ran
the same `restore_verified`): process 0 picks the name and broadcasts it, renames,
and a barrier holds every process until the rename is done, so no process lists the
directory while it changes and all of them then see the same steps.

`discard` is the other way out, for a step directory that has no commit marker and
never will (what a kill leaves when it interrupts pruning): deleted outright.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import numpy as np

from axcore.checkpoint.base import CheckpointError

MARK = ".corrupt-"
_MAX_NAME = 256  # Bytes of a set-aside name broadcast from process 0.


def move_aside(directory: str, name: str) -> str:
    """Renames `directory/name` to a free `directory/name.corrupt-<time>`; returns the new path.

    Raises:
        CheckpointError: the rename failed (the step stays where it was).
    """
    source = os.path.join(directory, name)
    chosen = _free_name(directory, name) if jax.process_index() == 0 else ""
    error = None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        chosen = _decode(multihost_utils.broadcast_one_to_all(_encode(chosen)))
    target = os.path.join(directory, chosen)
    if jax.process_index() == 0:
        try:
            os.rename(source, target)
        except OSError as e:
            error = f"{type(e).__name__}: {e.strerror or e}"
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"axcore_checkpoint_set_aside_{chosen}")
        if error is None and (os.path.exists(source) or not os.path.exists(target)):
            error = "process 0 could not rename it"
    if error is not None:
        raise CheckpointError(f"Cannot move {source} aside to {target}: {error}.", reason=f"cannot rename it: {error}")
    return target


def discard(directory: str, name: str) -> None:
    """Deletes the uncommitted step directory `directory/name` (the caller checked it has no commit marker).

    Raises:
        CheckpointError: it could not be deleted (naming it and why).
    """
    path = os.path.join(directory, name)
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointError(f"Cannot delete {path}: {e.strerror or e}.", reason=f"cannot delete it: {e}") from None


def _free_name(directory: str, name: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    candidate, n = f"{name}{MARK}{stamp}", 1
    while os.path.lexists(os.path.join(directory, candidate)):
        n += 1
        candidate = f"{name}{MARK}{stamp}-{n}"
    return candidate


def _encode(name: str) -> np.ndarray:
    raw = name.encode()
    if len(raw) > _MAX_NAME:
        raise CheckpointError(f"Cannot move {name} aside: its name is longer than {_MAX_NAME} bytes.")
    out = np.zeros(_MAX_NAME, np.int32)
    out[: len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _decode(codes: np.ndarray) -> str:
    return bytes(int(c) for c in np.asarray(codes) if c).decode()
