"""The engine's background thread, and `Engine.stream` on top of it.

`EngineDriver` runs `engine.step()` in a daemon thread while requests are live and
sleeps on a condition otherwise (woken by `wake`, which `add_request` calls). A step
that raises hands the error to every live request (`Engine.fail`) and the thread goes
on with later requests. `stream_outputs` registers a request whose sink puts each output
on an asyncio queue of the caller's event loop (thread-safe) and yields them; closing
the iterator before the last output aborts the request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from axcore.engine.requests import GenerationRequest, RequestOutput


class EngineDriver:
    """Steps `engine` in a background thread while it has live requests (started on first `wake`)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        """Starts the thread (idempotent)."""
        with self._wakeup:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="axcore-engine", daemon=True)
                self._thread.start()

    def wake(self) -> None:
        """A request arrived: the thread (if started) steps again."""
        with self._wakeup:
            self._wakeup.notify_all()

    def stop(self) -> None:
        """Ends the thread after its current step and waits for it."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopping and not self.engine.has_unfinished():
                    self._wakeup.wait()
                if self._stopping:
                    return
            try:
                self.engine.step()
            except Exception as error:  # Handed to the requests' streams, which raise it.
                self.engine.fail(error)


async def stream_outputs(engine: Any, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
    """Yields `request`'s outputs as the driver's steps produce them (see the module docstring)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def sink(item):
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    engine.add_request(request, sink)
    engine.driver.start()
    engine.driver.wake()
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            engine.abort(request.request_id)
