"""Orbax's and TensorStore's own reports of a failing save go to the run's log file, not the console.

When a save fails (a full disk, a lost mount), the backend raises one CheckpointError
whose line names the step and the cause; the trainer prints that line. Without this,
the console also got orbax's absl log records with their tracebacks (one per thread of
its save) and, from TensorStore's callback threads, a traceback per pending write
("Event loop is closed", after orbax closed the event loop the writes report to):
hundreds of lines before the one that says what happened.

`save_reports_to(path)` (the trainer wraps training in it, with
`checkpoint_log_file(run_dir)`: `<run_dir>/logs/checkpoint.log`) moves, while it is active:

- log records of WARNING and above emitted by orbax's modules (through absl's logger)
  into the file, with their tracebacks; other libraries' records are untouched;
- unraisable exceptions reported on threads other than the main thread (Python's
  `sys.unraisablehook`, which C++ callback threads report through) into the file;
  those of the main thread go to the previous hook as before;
- asyncio's reports of orbax's failed writes ("Task exception was never retrieved",
  logged through the `asyncio` logger when the task is garbage-collected): records whose
  exception's traceback passes through orbax. Such tasks, and the futures TensorStore
  completed with the write's error (no Python frames), are often collected only at
  exit, so when the block exits with an exception a filter stays on the `asyncio`
  logger that moves every record carrying an exception (the process is about to report
  the failure and exit; the next `save_reports_to` replaces it).

The file is created at its first report (so a run without failures has none) and
appended to; if it cannot be written (the disk that is full), reports are dropped.
`report_hint()` is the clause the backend's error line ends with while a file is set.
Process-wide (logging and the hook are), one at a time.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import pathlib
import sys
import threading
import traceback
from collections.abc import Iterator

# The logger orbax logs through (absl's Python logging).
_LOGGER = "absl"
# The logger asyncio reports exceptions nobody retrieved through.
_ASYNCIO_LOGGER = "asyncio"
_FORMAT = logging.Formatter("%(asctime)s %(levelname)s [%(threadName)s] %(pathname)s:%(lineno)d: %(message)s")


class _Report(logging.Filter):
    """Appends orbax's records and background threads' unraisable exceptions to `path`; drops them elsewhere."""

    def __init__(self, path: pathlib.Path, package_dirs: tuple[str, ...]):
        super().__init__()
        self.path = path
        self.package_dirs = package_dirs  # Orbax's package folders, each ending in os.sep.
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(text.rstrip("\n") + "\n")
            except OSError:  # The disk that failed the save may refuse this too; the error line still says why.
                pass

    def filter(self, record: logging.LogRecord) -> bool:
        """False (not shown) for orbax's records of WARNING and above, after writing them to the file."""
        if record.levelno < logging.WARNING or not os.path.abspath(record.pathname).startswith(self.package_dirs):
            return True
        self.write(_FORMAT.format(record))
        return False

    def unraisable(self, previous, unraisable) -> None:
        """`sys.unraisablehook`: background threads' exceptions to the file, the main thread's to `previous`."""
        if threading.current_thread() is threading.main_thread():
            previous(unraisable)
            return
        where = f" in {unraisable.object!r}" if unraisable.object is not None else ""
        lines = traceback.format_exception(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
        self.write(f"Unraisable exception on thread {threading.current_thread().name}{where}:\n" + "".join(lines))


class _AsyncioReport(logging.Filter):
    """Moves asyncio's records whose exception's traceback passes through orbax (any, after a failure) to the file."""

    def __init__(self, report: _Report):
        super().__init__()
        self.report = report
        self.after_failure = False  # Set when the block failed: every record with an exception is moved.

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or not (self.after_failure or _passes_through(error, self.report.package_dirs)):
            return True
        self.report.write(_FORMAT.format(record))
        return False


def _passes_through(error: BaseException, package_dirs: tuple[str, ...]) -> bool:
    """Whether a frame of `error`'s traceback (or of its causes') is in one of `package_dirs`."""
    seen = set()
    while error is not None and id(error) not in seen and package_dirs:
        seen.add(id(error))
        for frame, _ in traceback.walk_tb(error.__traceback__):
            if os.path.abspath(frame.f_code.co_filename).startswith(package_dirs):
                return True
        error = error.__cause__ or error.__context__
    return False


_active: _Report | None = None
_lingering: _AsyncioReport | None = None  # The asyncio filter a failed block left on; replaced by the next block's.


def _orbax_dirs() -> tuple[str, ...]:
    """The folders of the `orbax` package, found without importing it (none if it is not installed)."""
    spec = importlib.util.find_spec("orbax")
    folders = (spec.submodule_search_locations or ()) if spec is not None else ()
    return tuple(os.path.join(os.path.abspath(folder), "") for folder in folders)


def checkpoint_log_file(run_dir: str | os.PathLike, process_index: int = 0, process_count: int = 1) -> pathlib.Path:
    """The run's checkpoint log: `<run_dir>/logs/checkpoint.log`, `checkpoint-<process index>.log` with several processes."""
    name = "checkpoint.log" if process_count == 1 else f"checkpoint-{process_index}.log"
    return pathlib.Path(run_dir) / "logs" / name


@contextlib.contextmanager
def save_reports_to(path: str | os.PathLike) -> Iterator[None]:
    """Moves orbax's and background threads' failure reports into the file `path` while active (module docstring)."""
    global _active, _lingering
    report = _Report(pathlib.Path(path), _orbax_dirs())
    previous = sys.unraisablehook
    logger, asyncio_logger = logging.getLogger(_LOGGER), logging.getLogger(_ASYNCIO_LOGGER)
    asyncio_report = _AsyncioReport(report)
    logger.addFilter(report)
    asyncio_logger.removeFilter(_lingering)
    asyncio_logger.addFilter(asyncio_report)
    sys.unraisablehook = lambda unraisable: report.unraisable(previous, unraisable)
    _active = report
    failed = True
    try:
        yield
        failed = False
    finally:
        gc.collect()  # Orbax's abandoned tasks report now, while the file is set.
        _active = None
        sys.unraisablehook = previous
        logger.removeFilter(report)
        if failed:  # Tasks and futures collected later still report to the file (module docstring).
            asyncio_report.after_failure = True
            _lingering = asyncio_report
        else:
            asyncio_logger.removeFilter(asyncio_report)


def report_hint() -> str:
    """" (orbax's full report: PATH)" while `save_reports_to` is active, else ""."""
    report = _active
    return f" (orbax's full report: {report.path})" if report is not None else ""
