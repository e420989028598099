"""Which adapter each batch row uses during a model call (per-request adapters in the inference engine).

The engine serves several adapters (e.g. LoRA) at once in ONE model call: a kernel whose
per-site state holds every resident adapter stacked on a leading "slot" axis gathers each
batch row's slot. The engine traces its model call inside

    with adapter_rows(index):      # index: [B] int32, the slot of each batch row (0 = no adapter, the base)
        ...

and such a kernel reads `current_adapter_rows()` (None outside: no per-row adapters). The
rows are the leading axis of every activation of that call (`x [B, ...]`). Nothing here
knows a particular adapter kind; the kernel that stores the stacked state owns its layout.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_ROWS: contextvars.ContextVar[Any] = contextvars.ContextVar("axcore_adapter_rows", default=None)


@contextlib.contextmanager
def adapter_rows(index: Any) -> Iterator[None]:
    """Within the block, `current_adapter_rows()` is `index` (`[B]` int32 slot per batch row; 0 = the base)."""
    token = _ROWS.set(index)
    try:
        yield
    finally:
        _ROWS.reset(token)


def current_adapter_rows() -> Any:
    """The `[B]` int32 adapter slot of each batch row of the model call being traced, or None (no per-row adapters)."""
    return _ROWS.get()
