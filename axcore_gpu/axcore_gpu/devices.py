"""What a kernel may ask about the CUDA devices of a computation, at trace time only.

Nothing here runs when the plugin is imported: kernels call these functions from
`is_supported`, when a layer is traced and the backend is up anyway.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

# A CUDA device's `compute_capability` attribute reads like "9.0"; ROCm devices have none of that form.
_CAPABILITY = re.compile(r"(\d+)\.(\d+)")


def cuda_compute_capability(mesh: Any = None) -> tuple[int, int] | None:
    """`(major, minor)` of the CUDA devices of `mesh` (or of `jax.devices()`), or None.

    Args:
        mesh: a `jax.sharding.Mesh` whose devices are asked; None or an `AbstractMesh`
            (which has no devices) asks the process's default devices.

    Returns the lowest compute capability among the devices, or None when none of them
    is a CUDA device (CPU, ROCm, or a GPU target compiled for on a host without one).
    """
    devices = getattr(mesh, "devices", None)
    if devices is None:
        devices = jax.devices()
    found = []
    for device in np.ravel(np.asarray(devices, dtype=object)):
        match = _CAPABILITY.fullmatch(str(getattr(device, "compute_capability", "")))
        if match is None:
            return None
        found.append((int(match[1]), int(match[2])))
    return min(found) if found else None
