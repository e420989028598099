"""What the `axcore` commands share: the one-line parser, the multi-process arguments, the run lookup.

The experiment arguments (`add_experiment`, `overrides`) are plugin API and live in
`axcore.plugin.commands`, which plugins' commands import too.

Only argparse and the standard library are imported here, so `axcore --help` stays cheap.
"""

from __future__ import annotations

import argparse
import os

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # One line, exit 2 (argparse prints usage too).
        self.exit(EXIT_USAGE, f"axcore: error: {message} (see '{self.prog} --help')\n")


def add_distributed(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-process", "join a multi-process job (all three; or AXCORE_COORDINATOR_ADDRESS, "
        "AXCORE_NUM_PROCESSES, AXCORE_PROCESS_ID; Slurm and JobSet variables are detected)"
    )
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 .. N-1")


def _expanded(path: str) -> list[str]:
    """`path`, or the sorted paths a glob in it matches (a quoted `runs/mix-*` reaches us unexpanded) when
    nothing exists under the literal name; [] for a glob that matches nothing."""
    import glob  # Deferred with the rest of the run lookup: `axcore --help` stays cheap.

    if os.path.exists(path) or not glob.has_magic(path):
        return [path]
    return sorted(glob.glob(os.path.expanduser(path)))


def one_run(args) -> str:
    """The one run path of `eval` or `generate`; several (e.g. `runs/default-*`) are an AxcoreError naming them.

    A path with glob characters that names nothing as written is expanded (a quoted glob
    reaches the command unexpanded): one match is the run, none or several are refused.
    The error about several suggests the newest of them (latest modification time).
    """
    from axcore.errors import AxcoreError  # Deferred: only on the error path.

    paths = [p for given in [args.run, *args.more_runs] for p in _expanded(given)]
    if not paths:
        raise AxcoreError(
            f"'{args.run}' matches no run directory; give a run directory, its checkpoints/ or one step's directory."
        )
    if len(paths) == 1:
        return paths[0]

    def modified(path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return float("-inf")

    newest = max(paths, key=lambda p: (modified(p), p))
    raise AxcoreError(
        f"{len(paths)} run directories given ({', '.join(paths)}); axcore {args.command} reads one: name one, "
        f"e.g. the newest: {newest}"
    )
