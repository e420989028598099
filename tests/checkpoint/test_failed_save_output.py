"""A save that fails (a full disk) ends `axcore train` with one line, and orbax's own report goes to the
run's log file: no absl records, no tracebacks on the console.

The disk is made "full" for the training subprocess with RLIMIT_FSIZE (SIGXFSZ ignored, so a write past
the limit fails with EFBIG, "File too large", as ENOSPC would): the checkpoint's data file exceeds it,
the run's small files do not. In-process tests check what `save_reports_to` moves and what it leaves.
"""

import logging
import os
import subprocess
import sys
import threading
import types

import pytest

from axcore.checkpoint import checkpoint_log_file, save_reports_to
from axcore.testing import TINY_OVERRIDES

# Bytes any one file of the training process may grow to: more than its config (9 KB), metrics and
# checkpoint metadata (19 KB at most), less than the data files the tiny model's train state (parameters and
# two Adam moments, about 330 KB) is written into (26-133 KB each, measured).
FILE_SIZE_LIMIT = 24_000
# Runs argv[1:] with that limit and SIGXFSZ ignored (both survive exec; no preexec_fn, so no fork of this
# multithreaded process).
LIMITED = (
    "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE_SIZE_LIMIT}, {FILE_SIZE_LIMIT})); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


@pytest.mark.slow
def test_a_failed_save_is_one_line_and_orbax_reports_go_to_the_log_file(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*TINY_OVERRIDES, f"trainer.run_dir={run_dir}", "trainer.max_steps=4", "trainer.eval_every=0",
                 "trainer.sample.num_tokens=4", "trainer.checkpoint.every_n_steps=2"]
    command = [sys.executable, "-c", LIMITED, sys.executable, "-m", "axcore.cli", "train", "default",
               *(a for o in overrides for a in ("--set", o))]
    # No shared compilation cache: its entries would hit the limit too.
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**env, "JAX_PLATFORMS": "cpu"})
    errors = [line for line in result.stderr.splitlines() if line.startswith("axcore: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    log = checkpoint_log_file(run_dir)
    assert "Saving step 2" in errors[0] and f"orbax's full report: {log}" in errors[0], errors[0]
    for noise in ("Traceback", "absl", "Event loop", "ERROR:"):
        assert noise not in result.stderr, result.stderr[-3000:]
    assert len(result.stderr.splitlines()) < 15, result.stderr[-3000:]
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "File too large" in text, text[-3000:]
    assert (run_dir / "FAILED").exists()


def _orbax_record(level):
    import orbax.checkpoint

    path = os.path.join(os.path.dirname(orbax.checkpoint.__file__), "checkpoint_manager.py")
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        return logging.LogRecord("absl", level, path, 1, "save failed: %s", ("disk",), sys.exc_info())


def test_only_orbax_records_and_background_unraisables_are_moved(tmp_path):
    log = tmp_path / "logs" / "checkpoint.log"
    absl, seen = logging.getLogger("absl"), []
    handler = logging.Handler()
    handler.emit = seen.append
    absl.addHandler(handler)
    previous, main_thread_hook = sys.unraisablehook, []
    sys.unraisablehook = main_thread_hook.append
    try:
        with save_reports_to(log):
            absl.handle(_orbax_record(logging.ERROR))  # Moved, with its traceback.
            absl.handle(_orbax_record(logging.INFO))  # Below WARNING: left alone.
            absl.error("another library's error")  # Not orbax's: left alone.
            thread = threading.Thread(target=lambda: sys.unraisablehook(_unraisable("from a thread")))
            thread.start()
            thread.join()
            sys.unraisablehook(_unraisable("from the main thread"))
        absl.handle(_orbax_record(logging.ERROR))  # After: left alone.
    finally:
        absl.removeHandler(handler)
        sys.unraisablehook = previous
    assert [(r.levelno, r.getMessage()) for r in seen] == [
        (logging.INFO, "save failed: disk"), (logging.ERROR, "another library's error"), (logging.ERROR, "save failed: disk")
    ]
    assert [str(u.exc_value) for u in main_thread_hook] == ["from the main thread"]
    text = log.read_text()
    assert text.count("save failed: disk") == 1 and "No space left on device" in text and "Traceback" in text
    assert "RuntimeError: from a thread" in text and "from the main thread" not in text


def _unraisable(message):
    try:
        raise RuntimeError(message)
    except RuntimeError as e:
        return types.SimpleNamespace(exc_type=RuntimeError, exc_value=e, exc_traceback=e.__traceback__, err_msg=None,
                                     object=None)


def _abandoned_orbax_task_error():
    """Runs a task that fails in a function whose code lies in orbax's folder, and drops it unretrieved."""
    import asyncio

    import orbax.checkpoint

    namespace = {}
    fake = os.path.join(os.path.dirname(orbax.checkpoint.__file__), "fake_serialization.py")
    exec(compile("async def write():\n    raise ValueError('OUT_OF_RANGE: File too large')\n", fake, "exec"), namespace)
    loop = asyncio.new_event_loop()
    task = loop.create_task(namespace["write"]())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task  # Garbage-collected with its exception unretrieved: asyncio logs "Task exception was never retrieved".


def test_abandoned_orbax_tasks_go_to_the_file_also_after_a_failed_block(tmp_path):
    asyncio_logger, seen = logging.getLogger("asyncio"), []
    handler = logging.Handler()
    handler.emit = seen.append
    asyncio_logger.addHandler(handler)
    try:
        with pytest.raises(RuntimeError), save_reports_to(tmp_path / "first.log"):
            raise RuntimeError("the save failed")
        _abandoned_orbax_task_error()  # After the failed block: still moved.
        asyncio_logger.error("a future's error without frames", exc_info=ValueError("tensorstore"))  # Moved too.
        asyncio_logger.error("asyncio's own report")  # No exception: left alone.
        with save_reports_to(tmp_path / "second.log"):
            _abandoned_orbax_task_error()  # While active: moved.
            asyncio_logger.error("another library's asyncio report", exc_info=ValueError("not orbax"))
        _abandoned_orbax_task_error()  # After a block that ended well: left alone.
    finally:
        asyncio_logger.removeHandler(handler)
    first, second = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    assert "never retrieved" in first and "File too large" in first and "fake_serialization.py" in first
    assert "a future's error without frames" in first and "ValueError: tensorstore" in first
    assert "never retrieved" in second and "another library" not in second
    assert [r.getMessage().splitlines()[0] for r in seen] == [
        "asyncio's own report", "another library's asyncio report", "Task exception was never retrieved"
    ]
