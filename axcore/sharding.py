"""Compatibility path: `axcore.sharding` is `axcore.platform.sharding`.

The flat layout's path that the README's sharding section named. Plugins written against the
flat layout keep importing from here; new code imports `axcore.platform.sharding`. Nothing
inside `axcore` imports this module (the import contracts say so).
"""

from axcore.platform.sharding import (
    DEFAULT_AXIS_RULES,
    AxisRules,
    activation_spec,
    batch_axes,
    batch_sharding,
    check_batch_size,
    constrain,
    logical_to_spec,
    make_mesh,
    mesh_axes_of,
    parameter_shardings,
    parameter_specs_to_partition,
    path_name,
    resolve_mesh_shape,
    resolve_rules,
)

__all__ = [
    "AxisRules",
    "DEFAULT_AXIS_RULES",
    "resolve_rules",
    "mesh_axes_of",
    "logical_to_spec",
    "activation_spec",
    "path_name",
    "parameter_specs_to_partition",
    "parameter_shardings",
    "batch_axes",
    "batch_sharding",
    "check_batch_size",
    "resolve_mesh_shape",
    "make_mesh",
    "constrain",
]
