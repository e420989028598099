"""The error raised for bad input data."""

from __future__ import annotations

from axcore.errors import AxcoreError


class DataError(AxcoreError):
    """Input data is missing or malformed, or an iterator state does not fit its data.

    The message names the offending file (and line, for JSONL) or setting and says
    what to do.
    """
