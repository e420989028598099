"""Checkpoint backends: the protocol, its errors, and the orbax and tensorstore backends.

The backends are registered by the built-in plugin `axcore.checkpoint.plugin` under
the names `orbax` and `tensorstore`; look them up in `registries.checkpoint_backends`.
The backend classes are imported lazily (PEP 562), so importing this package loads
neither JAX nor a storage library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axcore._lazy import lazy_exports
from axcore.checkpoint.base import (
    CheckpointBackend,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    restore_verified,
)

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
    "TensorStoreBackend",
    "restore_verified",
]


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


if TYPE_CHECKING:
    from axcore.checkpoint.orbax_backend import OrbaxBackend
    from axcore.checkpoint.tensorstore_backend import TensorStoreBackend
