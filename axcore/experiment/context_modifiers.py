"""The `context_parallel` config modifier: split long sequences over a `context` mesh axis.

In a mesh rule (YAML `mesh_rules[i].modifiers`, or `MeshRule.config_modifiers`):

    {type: context_parallel, size: 4, min_seq_len: 32768}

When `input.seq_len >= min_seq_len` it gives the mesh a `context` axis of `size` (or
resizes the one it has) carved out of the batch: the axis whose size is -1 shrinks
by `size` when the mesh has one, else the `data` axis is divided by `size`. The
default axis rules map the logical `seq` axis to `context`, so activations are split
along the sequence and attention runs through the context-parallel kernels
(`axcore.kernels.attention_context`); `model.context_load_balance` is set to
`load_balance` where the model has that field. Below `min_seq_len` the config is
returned unchanged. See docs/context_parallelism.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from axcore.errors import ConfigError
from axcore.experiment.config_modifiers import Modifier, _field
from axcore.markers import hookimpl
from axcore.platform.mesh import CONTEXT_AXIS


def context_parallel(size: int, min_seq_len: int = 0, load_balance: bool = True) -> Modifier:
    """Adds (or resizes) a `context` mesh axis of `size` when `input.seq_len >= min_seq_len` (module docstring)."""
    this = Modifier("context_parallel", {"size": size, "min_seq_len": min_seq_len, "load_balance": load_balance})
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"Config modifier {this}: size must be a positive integer.")
    if not isinstance(min_seq_len, int) or min_seq_len < 0:
        raise ConfigError(f"Config modifier {this}: min_seq_len must be a non-negative integer.")

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        seq_len = _field(self, config, "input.seq_len")
        if seq_len < min_seq_len:
            return config
        chunks = 2 * size if load_balance else size
        if seq_len % chunks:
            raise ConfigError(
                f"Config modifier {self}: input.seq_len {seq_len} must be a multiple of {chunks} (the sequence is cut "
                f"into {'2 * ' if load_balance else ''}{size} pieces); change seq_len or size."
            )
        mesh = _field(self, config, "mesh")
        shape = list(mesh.mesh_shape or (-1,))
        names = list(mesh.mesh_axis_names or ("data",))
        if CONTEXT_AXIS in names:
            shape[names.index(CONTEXT_AXIS)] = size
        elif -1 in shape:
            shape.append(size)
            names.append(CONTEXT_AXIS)
        elif "data" in names and shape[names.index("data")] % size == 0:
            shape[names.index("data")] //= size
            shape.append(size)
            names.append(CONTEXT_AXIS)
        else:
            raise ConfigError(
                f"Config modifier {self}: the mesh {dict(zip(names, shape))} has no -1 axis and no 'data' axis "
                f"divisible by {size} to take the context axis from; give the rule a -1 axis."
            )
        new = config.clone()
        new.mesh.mesh_shape = tuple(shape)
        new.mesh.mesh_axis_names = tuple(names)
        if "context_load_balance" in new.model.keys():
            new.model.context_load_balance = load_balance
        return new

    return dataclasses.replace(this, fn=fn)


@hookimpl
def axcore_register_config_modifiers(register):
    register("context_parallel", context_parallel)
