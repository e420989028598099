"""Checkpointable Grain datasets the pipeline needs beyond Grain's own: streamed documents and a chain.

`DocumentStream` reads a `StreamedSource` front to back and yields the raw documents
`(location, raw)` of one split and one data shard: raw document k of the source (in
source order) belongs to the split by `axcore.data.sources.is_eval_document(k)`, and
the j-th document of the split to shard `j % num_shards`. TRAIN repeats endlessly
(epoch after epoch, the same order; the pipeline shuffles in a window after it), EVAL
is one pass. Its state is three counters per epoch, `{"epoch", "read", "taken",
"yielded"}` (plain ints): restoring re-opens the source and skips `read` raw documents
(they are parsed, not tokenized), so resuming a streamed source costs a re-read of the
current epoch's files up to that point; prepared shards resume in O(1).

`EpochOrder` is the endless TRAIN order of a random-access source's shard: epoch e
visits the shard's documents in `np.random.default_rng([seed, e]).permutation` order
(or as listed, unshuffled); its element i is document `order(e)[i - e*n]`, so a Grain
`MapDataset` over it resumes from one index.

`ChainDataset` yields all of its first parent, then all of the next ...: a mixture's
EVAL split, each component's eval documents one after the other, so every one counts once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from axcore.data.errors import DataError
from axcore.data.sources import Split, StreamedSource, is_eval_document


class DocumentStream(grain.IterDataset):
    """Raw documents `(location, raw)` of `split` for data shard `shard` of `num_shards` (module docstring)."""

    def __init__(self, source: StreamedSource, split: Split, shard: int, num_shards: int):
        super().__init__()
        self._source, self._split, self._shard, self._num_shards = source, split, shard, num_shards

    def __iter__(self) -> grain.DatasetIterator:
        return _DocumentStreamIterator(self._source, self._split, self._shard, self._num_shards)

    def __str__(self) -> str:
        return f"DocumentStream({self._source.describe()}, {self._split.value}, shard {self._shard}/{self._num_shards})"


class _DocumentStreamIterator(grain.DatasetIterator):
    def __init__(self, source: StreamedSource, split: Split, shard: int, num_shards: int):
        super().__init__()
        self._source, self._split, self._shard, self._num_shards = source, split, shard, num_shards
        self._fraction = source.config.eval_fraction
        self._state = {"epoch": 0, "read": 0, "taken": 0, "yielded": 0}
        self._documents: Iterator[tuple[str, Any]] | None = None

    def _open(self) -> Iterator[tuple[str, Any]]:
        documents = self._source.raw_documents()
        for _ in range(self._state["read"]):
            if next(documents, None) is None:
                raise DataError(
                    f"{self._source.where} ({self._source.describe()}): the saved input state has read "
                    f"{self._state['read']} documents of an epoch, but the data now holds fewer; "
                    f"resume with the data the run started with."
                )
        return documents

    def __next__(self) -> tuple[str, Any]:
        state, eval_split = self._state, self._split is Split.EVAL
        while True:
            if self._documents is None:
                self._documents = self._open()
            item = next(self._documents, None)
            if item is None:
                self._end_of_epoch()
                if eval_split:
                    raise StopIteration
                state.update(epoch=state["epoch"] + 1, read=0, taken=0, yielded=0)
                self._documents = None
                continue
            k = state["read"]
            state["read"] += 1
            if is_eval_document(k, self._fraction) != eval_split:
                continue
            j = state["taken"]
            state["taken"] += 1
            if j % self._num_shards != self._shard:
                continue
            state["yielded"] += 1
            return item

    def _end_of_epoch(self) -> None:
        state, source = self._state, self._source
        if state["taken"] == 0:
            hint = "add documents or raise eval_fraction" if self._split is Split.EVAL else "add documents"
            raise DataError(
                f"{source.where} ({source.describe()}): the {self._split.value} split holds no documents "
                f"({state['read']} in all, eval_fraction={self._fraction}); {hint}."
            )
        if state["yielded"] == 0 and self._split is Split.TRAIN:
            raise DataError(
                f"{source.where} ({source.describe()}): data shard {self._shard} of {self._num_shards} gets none "
                f"of the {state['taken']} train documents; lower input.data_shards or add documents."
            )

    def get_state(self) -> dict[str, int]:
        return dict(self._state)

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != set(self._state):
            raise DataError(f"Input state {state!r} is not a streamed source's state; was it saved for other data?")
        self._state = {k: int(v) for k, v in state.items()}
        self._documents = None


class EpochOrder(Sequence):
    """Document indices `documents`, epoch after epoch, reshuffled per epoch (module docstring); endless."""

    def __init__(self, documents: np.ndarray, seed: int, shuffle: bool):
        self._documents, self._seed, self._shuffle = np.asarray(documents), seed, shuffle  # Any integer dtype.
        self._cached: tuple[int, np.ndarray] = (-1, self._documents)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # Picklable for Grain's worker processes (the lock is recreated).
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, i: int) -> int:
        epoch, j = divmod(int(i), len(self._documents))
        if not self._shuffle:
            return int(self._documents[j])
        with self._lock:
            if self._cached[0] != epoch:
                permutation = np.random.default_rng([self._seed, epoch]).permutation(len(self._documents))
                self._cached = (epoch, self._documents[permutation])
            return int(self._cached[1][j])


class ChainDataset(grain.IterDataset):
    """All elements of `parents[0]`, then of `parents[1]`, ...; checkpointable (module docstring)."""

    def __init__(self, parents: Sequence[grain.IterDataset]):
        super().__init__(list(parents))

    def __iter__(self) -> grain.DatasetIterator:
        return _ChainIterator([iter(p) for p in self._parents])


class _ChainIterator(grain.DatasetIterator):
    def __init__(self, parents: list[grain.DatasetIterator]):
        super().__init__(parents)
        self._current = 0

    def __next__(self) -> Any:
        while self._current < len(self._parents):
            try:
                return next(self._parents[self._current])
            except StopIteration:
                self._current += 1
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"current": self._current, "parents": [p.get_state() for p in self._parents]}

    def set_state(self, state: dict[str, Any]) -> None:
        self._current = int(state["current"])
        for parent, parent_state in zip(self._parents, state["parents"]):
            parent.set_state(parent_state)
