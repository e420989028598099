"""What a kernel may ask about the CUDA devices of a computation, at trace time only.

Nothing here runs when the plugin is imported: kernels call these functions from
`is_supported`, when a layer is traced and the backend is up anyway.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from axcore.kernels import current_environment
from axcore.platform.mesh import InstanceType

# A CUDA device's `compute_capability` attribute reads like "9.0"; ROCm devices have none of that form.
_CAPABILITY = re.compile(r"(\d+)\.(\d+)")
# Compute capability of each device kind of the GPU mesh rules, for resolving a `gpu-<kind>-N`
# experiment on a machine without that GPU (`--mesh-selector gpu-h100-8` on a laptop).
KIND_CAPABILITIES = {"a100": (8, 0), "h100": (9, 0), "h200": (9, 0), "b200": (10, 0)}


def instance_type_capability(instance_type: str | None) -> tuple[int, int] | None:
    """The compute capability of `gpu-<kind>-N` for a kind of `KIND_CAPABILITIES`, else None."""
    parsed = InstanceType.parse(instance_type) if instance_type else None
    if parsed and parsed.platform == "gpu" and parsed.count is not None:
        return KIND_CAPABILITIES.get(parsed.kind)
    return None


def cuda_compute_capability(mesh: Any = None) -> tuple[int, int] | None:
    """`(major, minor)` of the CUDA devices of `mesh` (or of `jax.devices()`), or None.

    Args:
        mesh: a `jax.sharding.Mesh` whose devices are asked; None or an `AbstractMesh`
            (which has no devices) asks the process's default devices.

    Returns the lowest compute capability among the devices; when none of them is a CUDA
    device (CPU, ROCm, or a GPU target resolved on a host without one), the capability
    of the op environment's instance type (`gpu-h100-8` -> (9, 0)), else None.
    """
    devices = getattr(mesh, "devices", None)
    if devices is None:
        devices = jax.devices()
    found = _device_capabilities(devices)
    if found is None:
        return instance_type_capability(current_environment().instance_type)
    return min(found) if found else None


def _device_capabilities(devices: Any) -> list[tuple[int, int]] | None:
    """Capabilities of `devices`, or None if any is not a CUDA device."""
    found = []
    for device in np.ravel(np.asarray(devices, dtype=object)):
        match = _CAPABILITY.fullmatch(str(getattr(device, "compute_capability", "")))
        if match is None:
            return None
        found.append((int(match[1]), int(match[2])))
    return found
