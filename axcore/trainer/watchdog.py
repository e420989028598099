"""Hang detection for the training loop: log every thread's stack, then exit non-zero.

The training loop calls `Watchdog.beat(step)` whenever it makes progress. When no beat
comes for `step_timeout_s` seconds, the watchdog appends the stacks of all threads to
its log file (`<run_dir>/watchdog.log`; `watchdog-<process index>.log` in a
multi-process job, where every process runs its own watchdog, since a lost peer shows
up as a hang in a collective) and prints one line to stderr naming the step, the
seconds elapsed and the log file. If still no beat comes within `exit_timeout_s`
more seconds, the process exits with status `EXIT_HANG` (124, as timeout(1) does)
without any cleanup, so that an outer scheduler restarts the job, which then resumes
from the last committed checkpoint. A beat after the stacks were written cancels the
exit (the step was slow, not hung).

The watchdog is disarmed until the first beat: the trainer beats after the first step
was dispatched, so restoring a checkpoint and compiling the first step are never
timed. Timing is from beat to beat; the trainer also beats before and after evals and
checkpoint saves, so each of them gets a whole `step_timeout_s` of its own. Steps are
dispatched asynchronously, so the gap that ends at a metrics fetch holds the device time
of every step queued since the previous fetch (up to `log_every` steps): set the timeout
well above that.

Two mechanisms, because a hung main thread may be stuck in a C call that holds the
GIL, so that no Python thread ever runs again:

- a Python thread writes the stacks (with thread names) at `step_timeout_s` and
  calls `os._exit(EXIT_HANG)` at `step_timeout_s + exit_timeout_s`;
- `faulthandler.dump_traceback_later` (a C thread that needs no GIL) is the
  backstop: it writes faulthandler's stack dump to the same file and exits with
  status 1 a grace period (10% of the total, at least 1 s) after the Python thread
  would have. With `exit_timeout_s = 0` it only writes the stacks, at
  `step_timeout_s` plus the grace period, unless the Python thread already did.

faulthandler has one such timer per process: while a watchdog is armed, another user
of `dump_traceback_later` would replace it (and vice versa). `stop()` joins the
thread and cancels the timer; after it nothing fires.
"""

from __future__ import annotations

import faulthandler
import os
import pathlib
import sys
import threading
import time
import traceback
from typing import TextIO

from axcore.errors import ConfigError
from axcore.platform import exit_hooks

# Exit status of a process the watchdog ends (the faulthandler backstop exits with 1).
EXIT_HANG = 124


class Watchdog:
    """Writes all thread stacks when no `beat()` comes for `step_timeout_s`, exits after `exit_timeout_s` more.

    Args:
        step_timeout_s: seconds without a beat before the stacks are written; 0 disables the watchdog.
        exit_timeout_s: seconds after the stacks were written before the process exits
            with `EXIT_HANG`; 0 = only write the stacks, never exit.
        log_path: file the stacks are appended to (created, with its directory, when armed).
        stream: where the one-line message goes (default sys.stderr).

    Raises:
        ConfigError: a negative timeout.

    Use: `beat(step, activity)` from the loop (the first beat arms it), `stop()` at the
    end (also as a context manager). Beats are cheap (a clock read and an assignment).
    """

    def __init__(self, step_timeout_s: float, exit_timeout_s: float, log_path: str | os.PathLike,
                 *, stream: TextIO | None = None):
        for name, value in (("step_timeout_s", step_timeout_s), ("exit_timeout_s", exit_timeout_s)):
            if not value >= 0:
                raise ConfigError(f"'trainer.watchdog.{name}' must be >= 0 seconds (0 disables), got {value}.")
        self.step_timeout_s, self.exit_timeout_s = float(step_timeout_s), float(exit_timeout_s)
        self.log_path = pathlib.Path(log_path)
        self.stream = stream
        self.enabled = self.step_timeout_s > 0
        total = self.step_timeout_s + self.exit_timeout_s
        # How much later than the Python thread the faulthandler backstop fires; it is re-armed every grace/2.
        self._grace = max(1.0, 0.1 * total)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._dumped_beat = None  # The beat whose stacks were written (the thread then waits to exit).
        self._dumped_at = 0.0
        self._beat: tuple[float, int | None, str] = (0.0, None, "")
        self._armed_at = -float("inf")  # When faulthandler's timer was last (re)armed.
        self._file = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, cfg, run_dir: str | os.PathLike, process_index: int = 0, process_count: int = 1) -> Watchdog:
        """The watchdog of one process of a run, from a `WatchdogConfig`, logging into `run_dir`."""
        name = "watchdog.log" if process_count == 1 else f"watchdog-{process_index}.log"
        step_timeout_s = 0.0 if cfg.step_timeout_s is None else cfg.step_timeout_s  # null: off.
        return cls(step_timeout_s, cfg.exit_timeout_s, pathlib.Path(run_dir) / name)

    def beat(self, step: int | None = None, activity: str = "training") -> None:
        """Progress: restarts the timeout. `step`: the last step done (None keeps the previous);
        `activity`: what the process does until the next beat (named in the message)."""
        if not self.enabled or self._stopped:
            return
        now = time.monotonic()
        self._beat = (now, self._beat[1] if step is None else step, activity)
        if self._thread is None:
            self._arm()
        elif self._dumped_beat is not None or now - self._armed_at >= self._grace / 2:
            with self._lock:
                self._rearm_backstop()
            self._wake.set()

    def stop(self) -> None:
        """Disarms for good: joins the thread, cancels the faulthandler timer, closes the log. Idempotent."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._file is not None:
                faulthandler.cancel_dump_traceback_later()
                self._file.close()
                self._file = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- Internals ----------------------------------------------------------------

    def _arm(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.log_path, "a", encoding="utf-8")  # Closed by stop().
        with self._lock:
            self._rearm_backstop()
        self._thread = threading.Thread(target=self._run, name="axcore-watchdog", daemon=True)
        self._thread.start()

    def _rearm_backstop(self) -> None:
        """(Re)starts faulthandler's timer for the current beat; call with the lock held."""
        self._dumped_beat = None
        self._armed_at = time.monotonic()
        exits = self.exit_timeout_s > 0
        timeout = self.step_timeout_s + self.exit_timeout_s + self._grace
        faulthandler.dump_traceback_later(timeout, exit=exits, file=self._file)

    def _run(self) -> None:
        while not self._stopped:
            beat_time, step, activity = beat = self._beat
            if self._dumped_beat is not None and self._dumped_beat is not beat:
                with self._lock:  # Recovered: a beat came after the stacks were written.
                    if not self._stopped:
                        self._rearm_backstop()
            dumped = self._dumped_beat is beat
            if dumped:
                due = self._dumped_at + self.exit_timeout_s if self.exit_timeout_s else float("inf")
            else:
                due = beat_time + self.step_timeout_s
            delay = due - time.monotonic()
            if delay > 0:
                self._wake.wait(None if delay == float("inf") else delay)
                self._wake.clear()
                continue
            with self._lock:
                if self._stopped or self._beat is not beat:
                    continue  # A beat came (or stop()) while waking up.
                if dumped:
                    self._exit(step, activity, time.monotonic() - beat_time)
                self._dump(beat, time.monotonic() - beat_time)

    def _dump(self, beat: tuple[float, int | None, str], elapsed: float) -> None:
        """Writes all stacks and the one-line message; with the lock held."""
        _, step, activity = beat
        self._dumped_beat, self._dumped_at = beat, time.monotonic()
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"\n=== axcore watchdog, {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}: "
                 f"no progress for {elapsed:.1f} s ({activity}, last step {step}); all thread stacks ===\n"]
        for ident, frame in sys._current_frames().items():
            lines.append(f"\nThread {names.get(ident, '?')} ({ident}), most recent call last:\n")
            lines.extend(traceback.format_stack(frame))
        self._file.write("".join(lines))
        self._file.flush()
        if self.exit_timeout_s:
            then = f"exiting with status {EXIT_HANG} in {self.exit_timeout_s:g} s unless it recovers"
            # The backstop now guards the exit: faulthandler dumps again and exits 1 if this thread cannot.
            faulthandler.dump_traceback_later(self.exit_timeout_s + self._grace, exit=True, file=self._file)
        else:
            then = "not exiting (trainer.watchdog.exit_timeout_s=0)"
            faulthandler.cancel_dump_traceback_later()
        self._message(f"no progress for {elapsed:.1f} s ({activity}, last step {step}; timeout "
                      f"{self.step_timeout_s:g} s); all thread stacks written to {self.log_path}; {then}.")

    def _exit(self, step: int | None, activity: str, elapsed: float) -> None:
        text = (f"still no progress after {elapsed:.1f} s ({activity}, last step {step}); "
                f"exiting with status {EXIT_HANG} so that the job is restarted.")
        self._message(text)
        self._file.write(f"=== axcore watchdog: exited with status {EXIT_HANG} after {elapsed:.1f} s ===\n")
        self._file.flush()
        exit_hooks.run_all(f"watchdog: {text} (stacks in {self.log_path})")  # The run directory's clean-up.
        os._exit(EXIT_HANG)

    def _message(self, text: str) -> None:
        stream = self.stream or sys.stderr
        try:
            print(f"axcore: watchdog: {text}", file=stream, flush=True)
        except (OSError, ValueError):  # A closed stream must not keep the watchdog from exiting.
            pass
