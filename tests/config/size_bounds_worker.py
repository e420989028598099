"""Runs `axcore config` in-process on each case given as JSON on stdin; prints JSON results.

Run by `test_size_bounds.py` in a subprocess under an address-space limit
(`resource.RLIMIT_AS`), so a case that allocates in proportion to a bad value fails
the test (MemoryError, a traceback) instead of the machine. Input: a list of argv
lists (after `axcore`). Output: `{"results": [{"status", "stderr"}, ...],
"maxrss_growth_kb": ...}`, the growth of this process's peak resident memory over
all cases after the first (which pays for imports and the plugin registries).
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import sys
import traceback

from axcore import cli


def _run(argv: list[str]) -> dict:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            status = cli.main(argv)
        except BaseException:  # Reported to the test: a traceback is a failure it names.
            traceback.print_exc(file=err)
            status = -1
    return {"status": status, "stderr": err.getvalue()}


def main() -> None:
    cases = json.load(sys.stdin)
    results = [_run(cases[0])]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results += [_run(argv) for argv in cases[1:]]
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline
    json.dump({"results": results, "maxrss_growth_kb": growth}, sys.stdout)


if __name__ == "__main__":
    main()
