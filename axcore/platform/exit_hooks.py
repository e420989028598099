"""Last words before a process ends at once: what the run holding a directory does when `os._exit` comes.

Some failures end the process from a helper thread with `os._exit`, which skips
`finally` blocks and `atexit` because the main thread may be stuck in a collective or
a C call: the peer watch when another process of the job is lost
(`axcore.platform.peer_watch`), the training watchdog when a step hangs
(`axcore.trainer.watchdog`). Just before such an exit they call `run_all(message)`
with the one line that explains it; `register(callback)` adds a `callback(message)`
to what it runs. The trainer registers the clean-up of its run directory (FAILED
with that line, or the removal of a directory it created that holds nothing saved).

Each callback runs at most once, in the order registered; an exception in one is
swallowed (the process must still exit). Callbacks must be quick: file operations,
no collectives, no waiting on the main thread.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

_lock = threading.Lock()
_callbacks: dict[int, Callable[[str], None]] = {}
_ids = itertools.count()


def register(callback: Callable[[str], None]) -> Callable[[], None]:
    """Adds `callback(message)` to what `run_all` runs; returns the function that removes it again."""
    with _lock:
        key = next(_ids)
        _callbacks[key] = callback

    def unregister() -> None:
        with _lock:
            _callbacks.pop(key, None)

    return unregister


def run_all(message: str) -> None:
    """Runs (and removes) every registered callback with `message`; called just before `os._exit`."""
    with _lock:
        callbacks = list(_callbacks.values())
        _callbacks.clear()
    for callback in callbacks:
        try:
            callback(message)
        except BaseException:  # noqa: BLE001 - the process exits next whatever a callback does.
            pass
