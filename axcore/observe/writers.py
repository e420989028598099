"""Metrics writers: where the trainer sends scalar metrics each time it logs.

A writer takes `write(step, {name: scalar})` and `close()`. Names are free-form
paths such as `"train/loss"` or `"eval/loss"`; a step may carry any subset of the
names seen so far (train metrics every few steps, eval metrics more rarely).

- `JsonlWriter(path)`: one JSON object per line, flushed on every write.
- `TensorBoardWriter(logdir)`: TensorBoard event files (scalars), through tensorboardX.
- `MultiWriter([w1, w2])`: sends every write to each writer in turn.

The trainer builds its writers from configs (`trainer.metrics_writers`) through
registered factories (`axcore.observe.factories`).

In a multi-host run only one process (usually `jax.process_index() == 0`)
should write; that choice belongs to the caller.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from axcore.errors import AxcoreError

# How `JsonlWriter` spells non-finite floats: the strings Python's `json` module and
# JavaScript use, so NaN, +inf and -inf stay distinct; `read_jsonl_metrics` turns
# them back into floats.
NON_FINITE_SPELLING = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_RESERVED_KEYS = ("step", "time")


class MetricsError(AxcoreError, ValueError):
    """A metrics file cannot be read, or holds none of the metrics asked for."""


@runtime_checkable
class MetricsWriter(Protocol):
    """Receives scalar metrics from the training loop."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records `metrics` (name -> scalar) at `step`; keys may differ between steps."""

    def close(self) -> None:
        """Flushes and releases resources; the writer is not used afterwards."""


def _as_floats(step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Converts every value with `float()`, naming the metric that is not a scalar."""
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names must be str, got {name!r} at step {step}")
        try:
            out[name] = float(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"metric {name!r} at step {step} is not a scalar ({type(value).__name__}): {e}"
            ) from e
    return out


def _json_value(value: float) -> float | str:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


class JsonlWriter:
    """Appends `{"step": s, "time": unix_time, **metrics}` as one JSON line per write.

    Every value is converted with `float()` (so numpy and JAX scalars work) and
    non-finite values are written as the strings `"NaN"`, `"Infinity"` and
    `"-Infinity"` (the file stays strict JSON). Each line is written with one call
    and flushed at once, so a crashed process loses nothing already written; pass
    `fsync=True` to survive a machine crash too, at the cost of a sync per write.

    An existing file is appended to (a resumed run continues its log). If it ends
    in an incomplete line, left by a crash in the middle of a write, that line is
    cut off first so the file stays valid JSONL.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False):
        self.path = pathlib.Path(path)
        self._fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _truncate_torn_last_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file.closed:
            raise ValueError(f"JsonlWriter({str(self.path)!r}) is closed")
        values = _as_floats(step, metrics)
        clash = [k for k in _RESERVED_KEYS if k in values]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in {self.path} (step {step})")
        record = {"step": int(step), "time": time.time()}
        record.update({k: _json_value(v) for k, v in values.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _truncate_torn_last_line(path: pathlib.Path) -> None:
    """Cuts a final line that has no newline (a write interrupted by a crash)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Search backwards, a block at a time, for the newline that ends the last whole line.
        keep, pos = 0, size
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            pos = start
        warnings.warn(
            f"{path}: dropping an incomplete last line ({size - keep} bytes) "
            "left by an interrupted write",
            stacklevel=3,
        )
        f.truncate(keep)


def drop_records_after(path: str | os.PathLike[str], step: int) -> int:
    """Removes the records of steps after `step` from a metrics JSONL file; returns how many.

    A run resumed from checkpoint `step` redoes the later steps, so their records
    (logged before the interruption) would otherwise appear twice. The file is
    rewritten to a temporary file and renamed over the original, so an interruption
    leaves either the old file or the new one. A torn last line is dropped too.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return 0
    _truncate_torn_last_line(path)
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record_step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError, TypeError):
                record_step = 0  # Not ours to judge: kept.
            if record_step > step:
                dropped += 1
            else:
                kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def read_jsonl_metrics(path: str | os.PathLike[str]) -> list[dict]:
    """Reads a file written by `JsonlWriter` into a list of records, in file order.

    Each record is `{"step": int, "time": float, name: float, ...}`; the strings
    `"NaN"`, `"Infinity"` and `"-Infinity"` come back as floats and `null` as NaN.
    A final line without a newline that is not valid JSON (a write cut short by a
    crash) is skipped with a warning; any other bad line raises `MetricsError`.
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise MetricsError(f"cannot read metrics file {path}: {e}") from e
    lines = text.split("\n")
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines):  # last line and no newline after it: a torn write
                warnings.warn(f"{path}:{lineno}: skipping an incomplete last line", stacklevel=2)
                continue
            raise MetricsError(f"{path}:{lineno}: not a JSON line ({e})") from e
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsError(f"{path}:{lineno}: expected an object with an integer 'step'")
        for key, value in record.items():
            if value is None:
                record[key] = math.nan
            elif isinstance(value, str) and value in NON_FINITE_SPELLING:
                record[key] = NON_FINITE_SPELLING[value]
        records.append(record)
    return records


def _tensorboardx():
    """tensorboardX's `FileWriter`, `Event`, `SessionLog` and `Summary`, imported without PyTorch.

    tensorboardX's package imports `torch` when it is installed (only to accept its tensors
    in `add_histogram` and the like, which this writer never calls): 3-4 CPU seconds of every
    run's start on a machine with PyTorch. While tensorboardX is first imported, `torch` is
    marked absent (its `try: import torch` then falls back to NumPy); a process that already
    imported torch imports tensorboardX as it is. Imported here so that importing axcore
    never imports tensorboardX.
    """
    block = "tensorboardX" not in sys.modules and "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import FileWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
    finally:
        if block and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return FileWriter, Event, SessionLog, Summary


class TensorBoardWriter:
    """Writes scalars to TensorBoard event files in `logdir` (through tensorboardX).

    One event per `write` holds every metric of that step, each under its own tag
    (the metric name). Events are written by a background thread and reach the
    disk at least every `flush_secs` seconds, on `flush()` and on `close()`.
    NaN and infinities are written as they are; TensorBoard shows them as such.
    """

    def __init__(self, logdir: str | os.PathLike[str], *, flush_secs: float = 10.0, purge_step: int | None = None):
        """`purge_step`: TensorBoard hides the events of this step and later ones already in `logdir`
        (written before an interruption; a run resumed from step s passes s + 1)."""
        FileWriter, Event, SessionLog, Summary = _tensorboardx()

        self.logdir = pathlib.Path(logdir)
        self._summary = Summary
        self._writer = FileWriter(str(self.logdir), flush_secs=flush_secs)
        if purge_step is not None:
            self._writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self._writer.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._closed = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._closed:
            raise ValueError(f"TensorBoardWriter({str(self.logdir)!r}) is closed")
        values = _as_floats(step, metrics)
        summary = self._summary(
            value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        self._writer.add_summary(summary, global_step=int(step), walltime=time.time())

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MultiWriter:
    """Sends every write to each of `writers`, in order; `close()` closes them all."""

    def __init__(self, writers: Iterable[MetricsWriter]):
        self.writers = list(writers)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for writer in self.writers:
            writer.write(step, metrics)

    def close(self) -> None:
        """Closes every writer, even if one fails; the first failure is re-raised."""
        first_error: BaseException | None = None
        for writer in self.writers:
            try:
                writer.close()
            except Exception as e:  # the others must still be closed
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def __enter__(self) -> MultiWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
