"""Logical axis names -> mesh axes -> `NamedSharding`s for parameters and batches.

Model code names parameter dimensions with logical axes ("embed", "heads", ...);
the mesh rule chosen for the instance type maps them to mesh axes. A logical axis
without a rule, or a mesh axis that does not divide the dimension, is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axcore.errors import ConfigError
from axcore.params import ParameterSpec

AxisRules = Mapping[str, "str | tuple[str, ...] | None"]


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces one -1 in `shape` so that the product equals `num_devices`."""
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ConfigError(f"Mesh shape {tuple(shape)} may contain at most one -1.")
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if num_devices % known:
            raise ConfigError(f"Mesh shape {tuple(shape)} does not divide {num_devices} devices.")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ConfigError(
            f"Mesh shape {tuple(shape)} needs {math.prod(shape)} devices but {num_devices} are "
            f"available; set mesh.mesh_shape to match."
        )
    return tuple(shape)


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with `-1` resolved."""
    devices = list(devices if devices is not None else jax.devices())
    resolved = resolve_mesh_shape(shape, len(devices))
    return Mesh(np.asarray(devices).reshape(resolved), tuple(axis_names))


def logical_to_spec(
    mesh_axes: Sequence[str | None] | None, shape: Sequence[int], rules: AxisRules, mesh: Mesh
) -> PartitionSpec:
    """PartitionSpec for a parameter; undivisible or unmapped dimensions are replicated."""
    if mesh_axes is None:
        return PartitionSpec()
    out, used = [], set()
    for logical, dim in zip(mesh_axes, shape):
        target = rules.get(logical) if logical is not None else None
        names = (target,) if isinstance(target, str) else tuple(target or ())
        size = math.prod(mesh.shape[n] for n in names) if names else 1
        if not names or dim % size or used & set(names):
            out.append(None)
            continue
        used |= set(names)
        out.append(names[0] if len(names) == 1 else names)
    return PartitionSpec(*out)


# Mesh axes the batch dimension is split over when the axis rules do not map "batch".
DEFAULT_BATCH_AXES = ("data",)


def activation_spec(
    logical_axes: Sequence[str | None] | None, shape: Sequence[int], rules: AxisRules, mesh: Any
) -> PartitionSpec:
    """PartitionSpec of an activation with logical axes such as ("batch", "seq", "heads", None).

    Like `logical_to_spec`, with "batch" mapped to the data axes present in the mesh
    unless `rules` maps it.
    """
    if "batch" not in rules:
        rules = {**rules, "batch": tuple(a for a in DEFAULT_BATCH_AXES if a in mesh.axis_names) or None}
    return logical_to_spec(logical_axes, shape, rules, mesh)


def parameter_shardings(specs: Any, rules: AxisRules, mesh: Mesh) -> Any:
    """Tree of `NamedSharding` matching a `ParameterSpec` tree."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, logical_to_spec(s.mesh_axes, s.shape, rules, mesh)),
        specs,
        is_leaf=lambda x: isinstance(x, ParameterSpec),
    )


def batch_sharding(mesh: Mesh, batch_axes: Sequence[str] = DEFAULT_BATCH_AXES) -> NamedSharding:
    """Sharding of `[batch, ...]` inputs: batch over the data axes present in the mesh."""
    axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    return NamedSharding(mesh, PartitionSpec(axes if axes else None))
