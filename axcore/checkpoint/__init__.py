"""Checkpoint backends: the protocol, its errors, and the orbax and tensorstore backends.

The backends are registered by the built-in plugin `axcore.checkpoint.plugin` under
the names `orbax` and `tensorstore`; look them up in `registries.checkpoint_backends`.
The backend classes are imported lazily (PEP 562), so importing this package loads
neither JAX nor a storage library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from axcore.checkpoint.base import (
    CheckpointBackend,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
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
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'axcore.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from axcore.checkpoint.orbax_backend import OrbaxBackend
    from axcore.checkpoint.tensorstore_backend import TensorStoreBackend
