"""Built-in plugin: the orbax and tensorstore checkpoint backends.

The factories import their storage library only when called, so loading this plugin
(e.g. for `axcore plugins`) stays cheap. A factory's keyword arguments other than
`keep_last_n` and `async_save` are the backend's own settings, set in the experiment
as `trainer.checkpoint.backend_settings` (e.g. `{compress: true}` for orbax) and
checked against the factory's signature before the run.
"""

from __future__ import annotations

import os

from axcore.checkpoint.base import CheckpointBackend
from axcore.markers import hookimpl


def orbax(
    directory: str | os.PathLike, *, keep_last_n: int | None = 3, async_save: bool = True, compress: bool = False
) -> CheckpointBackend:
    """An `OrbaxBackend` (orbax-checkpoint's CheckpointManager) writing to `directory`; `compress`: zstd."""
    from axcore.checkpoint.orbax_backend import OrbaxBackend

    return OrbaxBackend(directory, keep_last_n=keep_last_n, async_save=async_save, compress=compress)


def tensorstore(directory: str | os.PathLike, *, keep_last_n: int | None = 3, async_save: bool = True) -> CheckpointBackend:
    """A `TensorStoreBackend` (zarr3 arrays written with tensorstore) writing to `directory`."""
    from axcore.checkpoint.tensorstore_backend import TensorStoreBackend

    return TensorStoreBackend(directory, keep_last_n=keep_last_n, async_save=async_save)


BACKENDS = {"orbax": orbax, "tensorstore": tensorstore}


@hookimpl
def axcore_register_checkpoint_backends(register):
    for name, factory in BACKENDS.items():
        register(name, factory)
