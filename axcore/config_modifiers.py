"""Compatibility path: `axcore.config_modifiers` is `axcore.experiment.config_modifiers`.

The flat layout's path that docs/hooks.md gave plugin authors (`Modifier` and the built-in
modifiers). Plugins written against the flat layout keep importing from here; new code
imports `axcore.experiment.config_modifiers`. Nothing inside `axcore` imports this module
(the import contracts say so).
"""

from axcore.experiment.config_modifiers import (
    BUILTIN_MODIFIERS,
    REMAT_POLICIES,
    Modifier,
    apply_modifier,
    attention_kernel,
    build_modifier,
    chunked_loss,
    compute_dtype,
    describe_modifier,
    matching_configs,
    mesh_shape,
    microbatches,
    remat,
)

__all__ = [
    "REMAT_POLICIES",
    "Modifier",
    "apply_modifier",
    "describe_modifier",
    "matching_configs",
    "mesh_shape",
    "remat",
    "microbatches",
    "attention_kernel",
    "chunked_loss",
    "compute_dtype",
    "BUILTIN_MODIFIERS",
    "build_modifier",
]
