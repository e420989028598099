"""Each prepared shard's files checked against their sha256 in index.json, once, while training reads.

`PreparedShards` checks sizes and `.npy` headers of every file when it opens (cheap,
synchronous); a flipped byte inside the data passes those. `ShardHashes` hashes the
files in background threads and `require(shard)` returns only once that shard's files
matched: `PreparedShards.document` calls it before it reads a shard's arrays, so no
document of a corrupt shard ever reaches a batch, and the read fails with one
DataError naming the file. Once any shard is found corrupt, every later `require`
raises that error, so a run stops at its next read rather than when (or if) it
reaches the corrupt shard.

Order: shards a reader waits for first (most recent request first), then every other
shard in index order, so later shards are usually checked before they are first read
and hashing overlaps training. The threads start at the first `require`, not at open
(`axcore config` opens the data without reading it). Each shard is hashed once per
process; a pickled copy (a worker process) keeps the results and hashes only what was
not yet checked.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Callable, Sequence

from axcore.data.errors import DataError

# Bytes read at a time while hashing (hashlib releases the GIL on large updates).
HASH_CHUNK = 1 << 22
# Threads hashing shards at once.
THREADS = 2
# A shard's state: not yet hashed, or matched; a mismatch is stored as the error's message.
_UNCHECKED, _MATCHED = None, True


def file_sha256(path: str) -> str:
    """The hex sha256 of the file at `path` (OSError if it cannot be read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ShardHashes:
    """The sha256 check of every shard's files, done once per shard in background threads (module docstring).

    Args:
        files: per shard, `(path, expected sha256)` of each of its files (empty: nothing to check).
        mismatch: `mismatch(path, problem)` -> the one-line message of the DataError for a file
            that does not match (`problem`: "does not match its sha256 in index.json", or why it
            cannot be read).
    """

    def __init__(self, files: Sequence[Sequence[tuple[str, str]]], mismatch: Callable[[str, str], str]):
        self._files = [list(f) for f in files]
        self._mismatch = mismatch
        self._results: list[bool | str | None] = [_MATCHED if not f else _UNCHECKED for f in self._files]
        self._failed: str | None = None  # The message of the first mismatch found.
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Condition()
        self._wanted: collections.deque[int] = collections.deque()  # Shards a reader waits for.
        self._taken: set[int] = set()  # Shards being hashed.
        self._next = 0  # The next shard in index order to consider when no reader waits.
        self._threads: list[threading.Thread] = []

    def __getstate__(self) -> dict:
        return {"_files": self._files, "_mismatch": self._mismatch, "_results": list(self._results), "_failed": self._failed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def require(self, shard: int) -> None:
        """Returns once `shard`'s files matched their sha256 (hashing them first if needed).

        Raises:
            DataError: a file of `shard`, or of any shard found corrupt before, does not match
                or cannot be read, naming it.
        """
        result = self._results[shard]
        if self._failed is not None:
            raise DataError(self._failed)
        if result is _UNCHECKED:
            with self._lock:
                if self._results[shard] is _UNCHECKED:
                    self._wanted.appendleft(shard)
                    self._start()
                    self._lock.notify_all()
                while self._results[shard] is _UNCHECKED:
                    self._lock.wait()
                result = self._results[shard]
        if result is not _MATCHED:
            raise DataError(result)

    def _start(self) -> None:
        """Starts the hashing threads once (under the lock)."""
        if self._threads:
            return
        for i in range(THREADS):
            thread = threading.Thread(target=self._work, name=f"axcore-shard-sha256-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _pick(self) -> int | None:
        """The next shard to hash (under the lock), marked taken; None when every shard is done or taken."""
        while self._wanted:
            shard = self._wanted.popleft()
            if self._results[shard] is _UNCHECKED and shard not in self._taken:
                self._taken.add(shard)
                return shard
        while self._next < len(self._results):
            shard, self._next = self._next, self._next + 1
            if self._results[shard] is _UNCHECKED and shard not in self._taken:
                self._taken.add(shard)
                return shard
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                shard = self._pick()
            if shard is None:
                return
            try:
                result = self._check(shard)
            except Exception as e:  # Never leave a reader waiting for a result that will not come.
                result = self._mismatch(self._files[shard][0][0], f"could not be checked ({type(e).__name__}: {e})")
            with self._lock:
                self._results[shard] = result
                if result is not _MATCHED and self._failed is None:
                    self._failed = result
                self._taken.discard(shard)
                self._lock.notify_all()

    def _check(self, shard: int) -> bool | str:
        """`_MATCHED`, or the message naming the first file of `shard` that does not match."""
        for path, want in self._files[shard]:
            try:
                got = file_sha256(path)
            except OSError as e:
                return self._mismatch(path, f"cannot be read ({e.strerror or e})")
            if got != want:
                return self._mismatch(path, "does not match its sha256 in index.json")
        return _MATCHED
