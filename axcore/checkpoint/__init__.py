"""Checkpoint backends: the protocol, its errors, and the orbax and tensorstore backends.

The backends are registered by the built-in plugin `axcore.checkpoint.plugin` under
the names `orbax` and `tensorstore`; look them up in `registries.checkpoint_backends`.
The backend classes are imported lazily (PEP 562), so importing this package loads
neither JAX nor a storage library. `save_reports_to(path)` moves orbax's own reports of
a failing save (log records, background threads' tracebacks) from the console into a
log file (the trainer's `<run_dir>/logs/checkpoint.log`).
"""

from __future__ import annotations

from axcore.checkpoint._save_log import checkpoint_log_file, save_reports_to
from axcore.checkpoint.base import (
    CheckpointBackend,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    restore_verified,
)
from axcore.config.lazy import lazy_exports

_LAZY = {
    "OrbaxBackend": "axcore.checkpoint.orbax_backend",
    "TensorStoreBackend": "axcore.checkpoint.tensorstore_backend",
}

__all__ = [
    "CheckpointBackend",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "OrbaxBackend",
    "checkpoint_log_file",
    "TensorStoreBackend",
    "restore_verified",
    "save_reports_to",
]


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
