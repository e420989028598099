"""Training progress as log lines: one line per metrics fetch.

    progress = ProgressLog(total_steps=300, start_step=restored_step, log_every=10)
    for step in range(restored_step + 1, 301):
        ...
        progress.update(step, loss, tokens_per_sec, step_time)
    progress.close()

writes, every `log_every` steps and at the last one (the loop reads metrics back from
the device only then, so there is nothing newer to show in between):

    step 120/300 | loss 2.513 | 10.9k tok/s | 0.19 s/step | ETA 0:00:34

The same lines on a terminal, in a log file and in CI: no line redrawn in place, so
output captured from a run reads as it was shown.
"""
from __future__ import annotations

import statistics
import sys
from collections import deque
from typing import TextIO


def format_duration(seconds: float) -> str:
    """Formats seconds as `H:MM:SS` (hours keep counting past 24): 50 -> '0:00:50'."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_rate(per_second: float) -> str:
    """Formats a rate with a k/M/G suffix: 10900 -> '10.9k', 950 -> '950'."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(per_second) >= scale:
            return f"{per_second / scale:.1f}{suffix}"
    return f"{per_second:.0f}"


def format_step_time(seconds: float) -> str:
    """Formats a step time: 0.19 -> '0.19 s/step', 0.0042 -> '4.20 ms/step'."""
    if seconds < 0.01:
        return f"{seconds * 1e3:.2f} ms/step"
    return f"{seconds:.2f} s/step"


class ProgressLog:
    """Writes training progress: step/total, loss, tokens/s, step time and ETA, one line each.

    `update(step, ...)` takes the number of steps completed so far (the step counter
    after the update), so the last update of a run has `step == total_steps`. A
    resumed run passes `start_step` (the restored step) and its first update is
    `start_step + 1`. A line is written when `step % log_every == 0` and at the last
    step; `close()` writes the latest status if no line showed it. The ETA is the
    median of the last `window` step times (robust to the slow first, compiling step)
    times the steps left.

    Args:
        total_steps: the step count at which training ends.
        stream: where to write; `None` means `sys.stderr` at construction time.
        log_every: steps between lines.
        start_step: the step training starts from (0, or the restored step).
        window: how many recent step times the ETA's median is taken over.
    """

    def __init__(self, total_steps: int, stream: TextIO | None = None, log_every: int = 10, start_step: int = 0,
                 *, window: int = 20):
        if total_steps < 0 or not 0 <= start_step <= total_steps:
            raise ValueError(
                f"need 0 <= start_step <= total_steps, got start_step={start_step}, "
                f"total_steps={total_steps}"
            )
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.total_steps = total_steps
        self.stream = sys.stderr if stream is None else stream
        self.log_every = log_every
        self.start_step = start_step
        self._step_times: deque[float] = deque(maxlen=window)
        self._pending: str | None = None  # The latest status no line showed yet.
        self._closed = False

    def eta_seconds(self, step: int) -> float | None:
        """Seconds left after `step`: median recent step time * steps left (None: no data)."""
        if not self._step_times:
            return None
        return statistics.median(self._step_times) * max(0, self.total_steps - step)

    def format_line(self, step: int, loss: float | None, tokens_per_sec: float | None,
                    step_time: float | None) -> str:
        """The status text for `step`, with no line ending."""
        eta = self.eta_seconds(step)
        parts = [
            f"step {step}/{self.total_steps}",
            f"loss {loss:.4g}" if loss is not None else "loss -",
            f"{format_rate(tokens_per_sec)} tok/s" if tokens_per_sec is not None else "- tok/s",
            format_step_time(step_time) if step_time is not None else "- s/step",
            f"ETA {format_duration(eta)}" if eta is not None else "ETA -",
        ]
        return " | ".join(parts)

    def update(self, step: int, loss: float | None, tokens_per_sec: float | None,
               step_time: float | None) -> None:
        """Records one completed step (see the class docstring) and writes its line when due.

        `loss` and `tokens_per_sec` may be None when not known at this step (shown as
        '-'); `step_time` is the seconds this step took, or None.
        """
        if self._closed:
            raise ValueError("ProgressLog.update() after close()")
        if step_time is not None:
            self._step_times.append(float(step_time))
        line = self.format_line(
            step,
            None if loss is None else float(loss),
            None if tokens_per_sec is None else float(tokens_per_sec),
            None if step_time is None else float(step_time),
        )
        if step % self.log_every == 0 or step >= self.total_steps:
            self._write(line)
        else:
            self._pending = line

    def close(self) -> None:
        """Writes the latest status if no line showed it yet."""
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            self._write(self._pending)

    def __enter__(self) -> ProgressLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
        self._pending = None
