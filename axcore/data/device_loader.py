"""Batches onto devices ahead of the step: each process builds only its own rows, in a thread.

    layout = shard_layout(sharding, (batch_size, seq_len), data_shards=None)
    pipeline = input_config.make_pipeline(Split.TRAIN, tokenizer, shards=layout.shards,
                                          num_shards=layout.num_shards)
    loader = DeviceLoader(pipeline, sharding, (batch_size, seq_len))
    item = next(loader)        # LoadedBatch(batch, state, exhausted)
    loader.take_wait()         # seconds the caller waited in next() since the last call

Data shards: the global batch of B rows is cut into S data shards of R = B // S
consecutive rows (shard s owns rows [s*R, (s+1)*R)); the input pipeline builds each
shard only from its own documents. S is `input.data_shards`, or (None) the number of
distinct row ranges the processes hold, i.e. the number of processes the batch is split
over. A process reads exactly the shards covering the rows its devices hold
(`sharding.devices_indices_map`); a layout where B is not a multiple of S, or where a
process's rows are not whole shards, is refused with one ConfigError line. So one
process with `data_shards=2` builds exactly the global batch two processes build
together, and a checkpoint's per-shard states resume under another process count as long
as S stays the same.

The loader runs the pipeline in one background thread with a bounded queue of
`buffer` batches: the thread reads the process's local rows `[len(shards) * R, T]`,
checks them against the batch schema, turns each field into a global array with
`jax.make_array_from_process_local_data` (every process passes only its own rows) and
queues `(batch, state, exhausted)` where `state` is `pipeline.state()` read right after
that batch, so the state saved with a checkpoint is the state after the last batch the
step consumed, never after batches still waiting in the queue. An exception raised in
the thread (a DataError naming a file) is re-raised, the same object, by `next()`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from axcore.data.pipeline import stats_from_counts
from axcore.data.schema import BATCH_SCHEMA, BatchSchema
from axcore.errors import ConfigError

# Batches buffered ahead of the step by default.
DEFAULT_BUFFER = 2
_END = object()  # Queued when the pipeline raises StopIteration.


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which data shards this process builds (see the module docstring)."""

    # S: data shards the global batch is cut into.
    num_shards: int
    # R = batch_size // S: rows per shard.
    rows_per_shard: int
    # The shards this process reads, ascending; its local rows are their rows in this order.
    shards: tuple[int, ...]

    @property
    def local_rows(self) -> int:
        return len(self.shards) * self.rows_per_shard


def _row_range(index: tuple, batch_size: int) -> tuple[int, int]:
    start, stop, _ = index[0].indices(batch_size) if index else (0, batch_size, 1)
    return start, stop


def shard_layout(sharding: jax.sharding.Sharding, global_shape: Sequence[int], data_shards: int | None) -> ShardLayout:
    """The data shards this process reads for batches of `global_shape` placed on `sharding`.

    Raises:
        ConfigError: batch_size is not a multiple of the shard count, or this process's
            rows are not whole shards (naming input.data_shards).
    """
    batch_size = int(global_shape[0])
    shape = tuple(int(d) for d in global_shape)
    rows_of: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        rows_of.setdefault(device.process_index, set()).add(_row_range(index, batch_size))
    me = jax.process_index()
    if data_shards is None:
        num_shards = len({frozenset(ranges) for ranges in rows_of.values()})
        where = f"the {num_shards} process(es) the batch is split over (input.data_shards=None)"
    else:
        num_shards = int(data_shards)
        where = f"input.data_shards={num_shards}"
    if num_shards < 1 or batch_size % num_shards:
        raise ConfigError(
            f"input.batch_size={batch_size} is not a multiple of {where}; set input.data_shards to a divisor of "
            f"input.batch_size."
        )
    rows = batch_size // num_shards
    local = _merge(sorted(rows_of.get(me, {(0, batch_size)})))  # Disjoint [start, stop) row intervals.
    if any(start % rows or stop % rows for start, stop in local):
        raise ConfigError(
            f"Process {me} holds batch rows {', '.join(f'{a}..{b - 1}' for a, b in local)}, which are not whole data "
            f"shards of {rows} rows ({where}); set input.data_shards so that each process's rows are whole shards "
            f"(e.g. a multiple of the process count)."
        )
    shards = tuple(s for start, stop in local for s in range(start // rows, stop // rows))
    return ShardLayout(num_shards, rows, shards)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted `[start, stop)` intervals merged where they overlap or touch (O(intervals), never O(rows))."""
    out: list[tuple[int, int]] = []
    for start, stop in intervals:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


@dataclasses.dataclass
class LoadedBatch:
    """One batch on the devices and the pipeline's position after it."""

    # {field: global jax.Array [batch_size, seq_len]} with the loader's sharding.
    batch: dict[str, jax.Array]
    # `pipeline.state()` read right after this batch (None if the pipeline has no state()).
    state: dict | None
    # `pipeline.exhausted` after this batch (eval pipelines: all documents used); False if absent.
    exhausted: bool
    # Rows and non-padding tokens (segment_ids > 0) this process read for it (its own rows only).
    rows: int = 0
    tokens: int = 0
    # `pipeline.counts()` taken right after this batch (additive; {} if the pipeline has none).
    counts: dict = dataclasses.field(default_factory=dict)


class DeviceLoader:
    """Iterates `LoadedBatch`es of a pipeline built in a background thread (module docstring).

    Args:
        pipeline: an iterator of host batches `{field: np.ndarray [local_rows, seq_len]}`,
            this process's rows only; optionally with `state()`, `exhausted`, `stats()` and
            `close()`. The loader's thread owns it from construction on: call nothing of it
            afterwards except through the loader (`stats()`, `close()`).
        sharding: the global batch's sharding.
        global_shape: `(batch_size, seq_len)`.
        local_rows: rows of each host batch (`ShardLayout.local_rows`); None = batch_size.
        buffer: batches queued ahead (>= 1).
        schema: the fields every batch must carry.
    """

    def __init__(
        self,
        pipeline: Iterator[dict[str, np.ndarray]],
        sharding: jax.sharding.Sharding,
        global_shape: Sequence[int],
        *,
        local_rows: int | None = None,
        buffer: int = DEFAULT_BUFFER,
        schema: BatchSchema = BATCH_SCHEMA,
        where: str = "The input pipeline",
    ):
        self.pipeline = pipeline
        self.sharding = sharding
        self.global_shape = tuple(int(d) for d in global_shape)
        self.local_rows = self.global_shape[0] if local_rows is None else int(local_rows)
        self.schema = schema
        self.where = where
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(buffer)))
        self._stop = threading.Event()
        self._counts: dict[str, int] = {}  # Summed `counts` of the batches consumed since the last stats().
        self._wait = 0.0
        self._done = False
        self._thread = threading.Thread(target=self._produce, name="axcore-device-loader", daemon=True)
        self._thread.start()

    # -- the background thread ---------------------------------------------------------

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _place(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        self.schema.check(host, self.local_rows, self.global_shape[1], where=self.where)
        return {
            name: jax.make_array_from_process_local_data(self.sharding, np.asarray(host[name]), self.global_shape)
            for name in self.schema.names
        }

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    host = next(self.pipeline)
                except StopIteration:
                    self._put(_END)
                    return
                state = self.pipeline.state() if hasattr(self.pipeline, "state") else None
                exhausted = bool(getattr(self.pipeline, "exhausted", False))
                counts = self.pipeline.counts() if hasattr(self.pipeline, "counts") else {}
                placed = self._place(host)
                rows, tokens = len(host["segment_ids"]), int(np.count_nonzero(host["segment_ids"]))
                if not self._put(LoadedBatch(placed, state, exhausted, rows, tokens, counts)):
                    return
        except BaseException as e:  # Re-raised by next() in the consuming thread.
            self._put(e)

    # -- the consumer ------------------------------------------------------------------

    def __iter__(self) -> DeviceLoader:
        return self

    def __next__(self) -> LoadedBatch:
        if self._done:
            raise StopIteration
        started = time.perf_counter()
        item = self._queue.get()
        self._wait += time.perf_counter() - started
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        for key, value in item.counts.items():
            self._counts[key] = self._counts.get(key, 0) + value
        return item

    def stats(self) -> dict[str, float]:
        """Packing efficiency and token counts of the batches consumed since the previous call
        (`stats_from_counts` of their summed `pipeline.counts()`; {} if the pipeline has none).
        Never waits for the background thread."""
        counts, self._counts = self._counts, {}
        return stats_from_counts(counts) if counts else {}

    def take_wait(self) -> float:
        """Seconds spent waiting in `next()` since the previous call (or the start)."""
        wait, self._wait = self._wait, 0.0
        return wait

    def close(self) -> None:
        """Stops the thread (dropping queued batches) and closes the pipeline."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()
        close = getattr(self.pipeline, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DEFAULT_BUFFER", "DeviceLoader", "LoadedBatch", "ShardLayout", "shard_layout"]
