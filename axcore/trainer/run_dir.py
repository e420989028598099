"""One run per directory: an exclusive lock, and the clean-up of runs that failed early.

A run holds `<run_dir>/.lock` with `fcntl.flock` for as long as it trains; the
kernel releases it when the process exits in any way (also SIGKILL), so a lock is
never stale. The file records the holder (host, pid, start time) for the message a
second run gets. On filesystems without `flock` (some network filesystems answer
ENOLCK or EOPNOTSUPP) the file is created exclusively instead, and a holder on this
host whose pid is gone is taken over as stale.

The lock is taken in two steps, so that a run refused after locking writes nothing:
`lock()` creates (if needed) and locks the directory, touching nothing but `.lock`;
`claim()` then makes it this run's (clears the marks below). `abandon()` gives up a
locked, unclaimed directory: unlocked, and removed (with the parents it created) if
this run created it. `acquire()` is `lock()` then `claim()`.

A run that fails before anything worth keeping exists, i.e. in a directory it
created itself and before its first committed checkpoint, removes the directory
(and the parent directories it created). Otherwise it leaves `<run_dir>/FAILED`
with the error line. A run stopped by Ctrl-C is cleaned up the same way but marked
`<run_dir>/INTERRUPTED` instead, with the line that says how to resume (see
`axcore/trainer/interrupt.py`). The next run in that directory removes either mark
when it claims the directory.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket

from axcore.errors import AxcoreError

# The lock file and the markers of a stopped run (axcore.placement.layout states the run directory's names).
from axcore.placement.layout import FAILED_FILE, INTERRUPTED_FILE, LOCK_FILE


class RunDirectoryError(AxcoreError):
    """A run directory cannot be used: another run holds it, or it cannot be created."""


def _holder_line(path: pathlib.Path) -> str:
    try:
        holder = json.loads(path.read_text("utf-8"))
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirectory:
    """An exclusively held run directory.

    `lock()` creates the directory (and its parents) if needed and takes the lock;
    `created` tells whether this run created the directory. `claim()` clears an
    earlier run's marks, `abandon()` gives the directory up unclaimed, `acquire()`
    does `lock()` and `claim()`. `release()` unlocks; `fail(message, committed)`
    cleans up after a failure and `interrupt(message, committed)` after Ctrl-C
    (module docstring).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        # Whether lock() created the directory (nothing of an earlier run is in it).
        self.created = False
        # The outermost directory lock() created (self.path or a parent of it), removed with it.
        self._created_root: pathlib.Path | None = None
        self._fd: int | None = None
        self._exclusive_file = False

    def acquire(self) -> None:
        """Creates, locks and claims the directory (`lock()`, then `claim()`).

        Raises:
            RunDirectoryError: as `lock()`.
        """
        self.lock()
        self.claim()

    def claim(self) -> None:
        """Makes the locked directory this run's: removes an earlier run's FAILED and INTERRUPTED marks."""
        self._clear_marks()

    def abandon(self) -> None:
        """Gives up the locked, unclaimed directory: unlocks it, and removes it if this run created it."""
        self.release()
        if self.created:
            self._remove()

    def lock(self) -> None:
        """Creates (with its parents) and locks the directory; writes nothing but the lock file.

        Raises:
            RunDirectoryError: another live process holds it (naming the holder), or
                it cannot be created (naming the path and the reason).
        """
        self.created = not self.path.exists()
        self._created_root = next((p for p in reversed((self.path, *self.path.parents)) if not p.exists()), None)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirectoryError(
                f"Cannot create the run directory '{self.path}': {e.strerror or e}; set trainer.run_dir to a "
                f"writable directory."
            ) from None
        lock = self.path / LOCK_FILE
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirectoryError(f"Cannot open the run lock '{lock}': {e.strerror or e}.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._held_error(lock) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise RunDirectoryError(f"Cannot lock the run directory '{self.path}': {e.strerror or e}.") from None
            self._acquire_exclusive_file(lock)
            return
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, self._holder_record())

    def _clear_marks(self) -> None:
        for mark in (FAILED_FILE, INTERRUPTED_FILE):
            (self.path / mark).unlink(missing_ok=True)

    def _holder_record(self) -> bytes:
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since}).encode()

    def _held_error(self, lock: pathlib.Path) -> RunDirectoryError:
        return RunDirectoryError(
            f"Run directory '{self.path}' is in use by another run ({_holder_line(lock)}); wait for it to finish, "
            f"stop it, or set trainer.run_dir to another directory."
        )

    def _acquire_exclusive_file(self, lock: pathlib.Path) -> None:
        """The fallback without flock: an exclusively created lock file; a dead local holder's is stale."""
        lock.unlink(missing_ok=True) if lock.stat().st_size == 0 else None  # Our own empty probe file.
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(lock.read_text("utf-8"))
                except (OSError, ValueError):
                    holder = {}
                stale = holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", 0)))
                if not stale:
                    raise self._held_error(lock) from None
                lock.unlink(missing_ok=True)
                continue
            os.write(fd, self._holder_record())
            os.close(fd)
            self._exclusive_file = True
            return
        raise self._held_error(lock)

    def release(self) -> None:
        """Unlocks (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)  # Closing the descriptor releases the flock.
            self._fd = None
        if self._exclusive_file:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
            self._exclusive_file = False

    def fail(self, message: str, *, committed: bool) -> str:
        """Cleans up after a failed run and releases the lock; returns what was done, as a sentence.

        Args:
            message: the error, one line (written to FAILED when the directory is kept).
            committed: whether the directory holds a committed checkpoint (of this
                run or an earlier one).
        """
        if not self._mark(FAILED_FILE, message, committed):
            return f"Removed the run directory {self.path} (nothing was saved in it)."
        return f"Marked {self.path} as failed ({FAILED_FILE}); its checkpoints are kept."

    def interrupt(self, message: str, *, committed: bool) -> bool:
        """Like `fail` after Ctrl-C, marking INTERRUPTED; returns whether the directory was kept."""
        return self._mark(INTERRUPTED_FILE, message, committed)

    def _mark(self, mark: str, message: str, committed: bool) -> bool:
        """Removes a directory this run created if nothing is committed, else writes `mark`; releases the lock."""
        if self.created and not committed:
            self.release()
            self._remove()
            return False
        try:
            (self.path / mark).write_text(message.rstrip() + "\n", "utf-8")
        except OSError:
            pass
        self.release()
        return True

    def _remove(self) -> None:
        """Removes the directory this run created, and the parents it created that are now empty."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._created_root is None or self._created_root == self.path:
            return
        for parent in self.path.parents:
            try:
                parent.rmdir()  # Only if empty: another run may have put something there meanwhile.
            except OSError:
                return
            if parent == self._created_root:
                return
