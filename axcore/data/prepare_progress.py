"""`axcore prepare`'s progress: the plan, a line of shards, documents, tokens, MB/s of input and ETA, and the
verification, so no phase of seconds is silent."""

from __future__ import annotations

import time
from typing import TextIO

# Seconds between lines when the stream is not a terminal.
_LINE_SECONDS = 5.0


class Progress:
    """Documents, tokens, MB/s and ETA on `stream`: one updated line on a terminal, else a line every few seconds."""

    def __init__(self, stream: TextIO | None, total_bytes: int, shards: int):
        self._stream = stream
        self._tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.total_bytes, self.shards = total_bytes, shards
        self.documents = self.tokens = self.bytes = self.done_shards = 0
        self._start = time.monotonic()
        self._bytes_at_start = 0
        self._last = 0.0

    def skipped(self, record: dict, nbytes: int) -> None:
        """A shard found finished (resume): counted, but not in the rate."""
        self.documents += record["documents"]
        self.tokens += record["tokens"]
        self.bytes += nbytes
        self._bytes_at_start += nbytes
        self.done_shards += 1

    def add(self, documents: int, tokens: int, nbytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = (self.bytes - self._bytes_at_start) / elapsed
        left = self.total_bytes - self.bytes
        eta = _duration(left / rate) if rate > 0 else "?"
        return (
            f"prepare: {self.done_shards}/{self.shards} shards, {self.documents:,} documents, {self.tokens:,} tokens, "
            f"{rate / 1e6:.1f} MB/s, ETA {eta}"
        )

    def say(self, text: str) -> None:
        """One line `prepare: TEXT` (a phase starting: the plan, the verification)."""
        if self._stream is not None:
            self._stream.write(f"prepare: {text}\n")
            self._stream.flush()

    def show(self, *, final: bool = False) -> None:
        if self._stream is None:
            return
        now = time.monotonic()
        if not final and now - self._last < (0.2 if self._tty else _LINE_SECONDS):
            return
        self._last = now
        if self._tty:
            self._stream.write("\r\033[K" + self.line() + ("\n" if final else ""))
        else:
            self._stream.write(self.line() + "\n")
        self._stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
