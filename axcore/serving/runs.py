"""One HTTP request's engine requests in flight: their merged outputs, the waiting bound, cancellation.

A completion with several prompts is several engine requests; `Run` consumes each one's
`EngineClient.stream` in a task of its own and hands their outputs to the handler in
arrival order. `Run.close()` cancels what is still running: each stream's task is
cancelled and the stream closed (`aclose`), which the engine takes as an abort that frees
the request's blocks. Handlers call it in a `finally` (and streaming responses again in a
background task that Starlette runs after a client disconnects), so no request outlives
its client.

The waiting bound (`--max-waiting`) counts engine requests this server accepted that
have no output yet (queued in the engine or in prefill): `Admission` refuses a request
that would push that count past the bound with a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from starlette.requests import Request

from axcore.engine.requests import EngineClient, GenerationRequest, RequestOutput, SamplingParamsError
from axcore.errors import AxcoreError
from axcore.serving.metrics import LatencyClock, ServerMetrics
from axcore.serving.protocol import RequestError

_END = object()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Admission:
    """Counts the engine requests that have no output yet; refuses past `max_waiting` (429)."""

    def __init__(self, max_waiting: int, metrics: ServerMetrics):
        self.max_waiting, self.metrics = max_waiting, metrics
        self.pending = 0

    def admit(self, count: int) -> None:
        """Takes `count` requests in, or raises RequestError 429 naming the bound."""
        if self.pending + count > self.max_waiting:
            raise RequestError(
                f"Too many requests waiting ({self.pending} waiting, bound {self.max_waiting}, set by the server's "
                f"--max-waiting); retry later.", status=429, type_="rate_limit_error", code="too_many_waiting",
            )
        self._add(count)

    def release(self) -> None:
        """One admitted request got its first output (or ended)."""
        self._add(-1)

    def _add(self, count: int) -> None:
        self.pending += count
        self.metrics.pending.set(self.pending)


def engine_error(error: Exception) -> Exception:
    """What the handler raises for an exception of the engine: a 400 for bad input (an AxcoreError), else it."""
    if isinstance(error, SamplingParamsError):
        return RequestError(str(error), param=error.field)
    if isinstance(error, AxcoreError) and not isinstance(error, RequestError):
        return RequestError(str(error))
    return error


class Run:
    """The engine requests of one HTTP request, streamed concurrently.

    Args:
        engine: the engine.
        requests: its requests; their outputs are yielded as `(k, output)`, k indexing `requests`.
        admission: the waiting bound (`admit` must already have counted these requests).
        metrics: where the latencies go.
        arrival: when the HTTP request arrived (`time.monotonic()`).
        poll_s: seconds between checks that the client is still there while `next` waits.
    """

    def __init__(self, engine: EngineClient, requests: Sequence[GenerationRequest], admission: Admission,
                 metrics: ServerMetrics, arrival: float, poll_s: float):
        self.engine, self.requests, self.admission = engine, list(requests), admission
        self.poll_s = poll_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.waiting = set(range(len(self.requests)))  # Admitted, no output yet.
        self.clocks = [LatencyClock(metrics, arrival) for _ in self.requests]
        self.streams: list = [None] * len(self.requests)
        self.running = len(self.requests)
        self.closed = False
        self.tasks = [asyncio.ensure_future(self._consume(k)) for k in range(len(self.requests))]

    async def _consume(self, k: int) -> None:
        try:
            self.streams[k] = self.engine.stream(self.requests[k])
            async for output in self.streams[k]:
                self.queue.put_nowait((k, output))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Handed to the handler, which answers it.
            self.queue.put_nowait((k, e))
            return
        self.queue.put_nowait((k, _END))

    async def next(self, request: Request | None = None) -> tuple[int, RequestOutput] | None:
        """The next output, `(k, output)`, or None when every request has finished.

        With `request`, checks every `poll_s` seconds that its client is still connected
        (raises ClientGone when not). Raises what the engine raised (see `engine_error`).
        """
        while self.running:
            if request is None:
                k, item = await self.queue.get()
            else:
                try:
                    k, item = await asyncio.wait_for(self.queue.get(), timeout=self.poll_s)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise ClientGone() from None
                    continue
            self._seen(k)
            if item is _END:
                self.running -= 1
                continue
            if isinstance(item, Exception):
                raise engine_error(item)
            self.clocks[k].observe([len(c.token_ids) for c in item.choices])
            return k, item
        return None

    def _seen(self, k: int) -> None:
        if k in self.waiting:
            self.waiting.discard(k)
            self.admission.release()

    async def finals(self, request: Request | None = None) -> list[RequestOutput]:
        """Every request's last output, by k (waits for all; see `next` for `request`)."""
        last: list[RequestOutput | None] = [None] * len(self.requests)
        while (item := await self.next(request)) is not None:
            last[item[0]] = item[1]
        missing = [self.requests[k].request_id for k, out in enumerate(last) if out is None or not out.finished]
        if missing:
            raise RuntimeError(f"the engine ended request {missing[0]} without a finished output")
        return last

    async def close(self) -> None:
        """Cancels every request still running (the engine aborts it) and releases its waiting slot.

        Idempotent, and safe to call again when a cancellation interrupted a first call: the
        cancellations and releases happen before the first await, the `aclose` calls after.
        """
        for task in self.tasks:
            task.cancel()
        for k in list(self.waiting):
            self._seen(k)
        if self.closed:
            return
        await asyncio.gather(*self.tasks, return_exceptions=True)  # Their cancellations, not ours.
        for stream in self.streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        self.closed = True
