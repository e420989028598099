"""Ctrl-C during training: save the last completed step, mark the run INTERRUPTED, say how to resume.

In a single-process run, the training loop holds an `InterruptGuard`: the first
SIGINT (Ctrl-C) only sets `requested`, which the loop reads as it dispatches each
step. The loop stays one step ahead of the device (axcore/trainer/trainer.py), so it
finishes the step the device runs and at most the one queued behind it, fetches
and checks the last like any logged step (a diverged step still stops the run as diverged,
unsaved), saves it, waits for the save's commit marker, and raises `RunInterrupted`.
The Trainer then leaves `<run_dir>/INTERRUPTED` (not FAILED; the next run there
removes it) and `axcore train` prints one line, e.g.

    Interrupted at step 37; saved. Resume with: axcore train exp.yaml --set trainer.run_dir=runs/exp-20260101-120000

and exits with status 130. A second Ctrl-C aborts at once: the line says so (and
which step the run will resume from), and the process exits 130 without waiting for
the save, whose step has no commit marker and so never counts; the previous
committed checkpoint is untouched.

A multi-process job saves nothing on Ctrl-C: a save is a collective that every
process must enter at the same step, and a SIGINT reaches the processes at different
steps (or only some of them), so the guard is not installed there. The interrupt is
an ordinary KeyboardInterrupt where it lands; the run is marked INTERRUPTED all the
same, and the line names the command that resumes from the latest committed
checkpoint. The guard is also not installed outside the main thread or when the
program replaced Python's own SIGINT handler.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from axcore.placement.layout import config_path
from axcore.trainer.run_dir import RunDirectory

# Exit status after SIGINT (128 + 2), the shell's convention.
EXIT_INTERRUPTED = 130


class RunInterrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C. `str()` is the one line for the user (what was saved, how to resume).

    `step`: the step the loop stopped after (None: not known, e.g. interrupted while
    restoring); `saved`: whether that step was saved and committed.
    """

    def __init__(self, message: str = "", *, step: int | None = None, saved: bool = False):
        super().__init__(message)
        self.step = step
        self.saved = saved


def resume_command(command: Sequence[str] | None, run_dir: pathlib.Path, run_dir_given: bool) -> str:
    """The shell command that resumes the run in `run_dir`.

    Args:
        command: the words that started the run (e.g. `axcore train exp.yaml --set
            a=1`), or None when it was started from code: then the run directory's
            own `config.yaml` (which loads back to exactly the config that ran).
        run_dir: the run directory.
        run_dir_given: whether the config named `trainer.run_dir` (else the run
            chose a timestamped one, which the command must name).
    """
    if command is None:
        words = ["axcore", "train", str(config_path(run_dir)), "--set", f"trainer.run_dir={run_dir}"]
    else:
        words = [*command, *(() if run_dir_given else ("--set", f"trainer.run_dir={run_dir}"))]
    return shlex.join(words)


def interrupted(
    run_dir: RunDirectory, error: KeyboardInterrupt, committed: bool, resume: str, multi_process: bool, primary: bool
) -> RunInterrupted:
    """After Ctrl-C stopped the run: marks `run_dir` INTERRUPTED (or removes it if this run created it and
    nothing is saved) on the primary process, and returns the `RunInterrupted` to raise, carrying the line.

    Args:
        run_dir: the locked run directory (released here).
        error: the interrupt; a `RunInterrupted` of the training loop says the step it saved.
        committed: whether the run directory holds a checkpoint.
        resume: the command that resumes the run (`resume_command`).
        multi_process: whether the job has several processes (they save nothing on Ctrl-C).
        primary: whether this is process 0 (the only one that marks the directory and prints).
    """
    step, saved = getattr(error, "step", None), getattr(error, "saved", False)
    if saved:
        line = f"Interrupted at step {step}; saved. Resume with: {resume}"
    elif committed:
        why = " (a multi-process job saves only at its checkpoint interval)" if multi_process else ""
        line = f"Interrupted; nothing new saved{why}. Resume from the latest checkpoint with: {resume}"
    else:
        line = f"Interrupted before anything was saved in {run_dir.path}."
    if primary and not run_dir.interrupt(line, committed=committed):
        line = f"Interrupted before anything was saved; removed the run directory {run_dir.path}."
    return RunInterrupted(line if primary else "", step=step, saved=saved)


def abort(run_dir: RunDirectory, backend: Any, committed: bool, resume: str, primary: bool) -> None:
    """A second Ctrl-C: marks `run_dir` and prints the step the run resumes from (`InterruptGuard` exits next).

    `backend`: the run's checkpoint backend (None before it exists), asked for its
    latest committed step; a save in flight has no commit marker and does not count.
    """
    try:
        latest = backend.latest_step() if backend is not None else None
    except Exception:  # Only for the message; the process ends either way.
        latest = None
    if latest is None:
        line = "Interrupted again; nothing was saved."
    else:
        line = f"Interrupted again: stopped at once, nothing more saved. Resume from step {latest} with: {resume}"
    if primary:
        if not run_dir.interrupt(line, committed=committed):
            line = f"Interrupted again before anything was saved; removed the run directory {run_dir.path}."
        print(line, file=sys.stderr, flush=True)


class InterruptGuard:
    """Turns the first SIGINT into a request the training loop honours at its next step (module docstring).

    `install()` replaces Python's default SIGINT handler (only when `enabled`, in the
    main thread, and when the handler is still Python's default); `uninstall()` puts
    the previous one back. While installed, the first SIGINT sets `requested`; a later
    one calls `on_abort()` (which prints and marks the run) and ends the process with
    status 130 at once, so a save in flight is abandoned before its commit marker.
    """

    def __init__(self, enabled: bool, on_abort: Callable[[], None] | None = None):
        self.enabled = enabled
        self.on_abort = on_abort
        # Whether a SIGINT arrived while installed.
        self.requested = False
        self._previous = None
        self._installed = False

    def install(self) -> None:
        if not self.enabled or self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        self._previous = signal.signal(signal.SIGINT, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.requested = True
            print("Ctrl-C: saving the current step, then stopping (Ctrl-C again aborts without saving).",
                  file=sys.stderr, flush=True)
            return
        try:
            if self.on_abort is not None:
                self.on_abort()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
