"""`axcore loc`: the integration lines of code of each installed plugin, as a Markdown table.

The report lives in the developer tools (`axcore_devtools`, not in the runtime package):
`pip install ./devtools` from an axcore checkout.
"""

from __future__ import annotations

import importlib
import sys

from axcore.errors import AxcoreError

# The module computing the report, in the axcore-devtools distribution (devtools/ of the repository).
REPORT_MODULE = "axcore_devtools.loc_report"


def run(args) -> int:
    """Prints the table; AxcoreError (exit 2) if the developer tools are not installed."""
    try:
        report = importlib.import_module(REPORT_MODULE)
    except ModuleNotFoundError as e:
        if e.name is None or not REPORT_MODULE.startswith(e.name):
            raise
        raise AxcoreError(
            "axcore loc needs axcore's developer tools (axcore-devtools), which are not installed: "
            "run `pip install ./devtools` in an axcore checkout."
        ) from None
    sys.stdout.write(report.format_table(report.loc_report()))
    return 0
