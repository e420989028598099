"""`axcore loc`: the integration lines of code of each installed plugin, as a Markdown table."""

from __future__ import annotations

import sys


def run(args) -> int:
    from axcore.tools.loc_report import format_table, loc_report

    sys.stdout.write(format_table(loc_report()))
    return 0
