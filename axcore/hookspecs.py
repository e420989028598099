"""Compatibility path: `axcore.hookspecs` is `axcore.plugin.hookspecs`.

The flat layout's path that docs/hooks.md, the README and DESIGN.md name as the plugin API.
Plugins written against the flat layout keep importing from here; new code imports
`axcore.plugin.hookspecs`. Nothing inside `axcore` imports this module (the import contracts
say so).
"""

from axcore.plugin.hookspecs import (
    KERNELS,
    PLUGIN_API_VERSION,
    axcore_add_hookspecs,
    axcore_flags_environment,
    axcore_probe_instance_type,
    axcore_register_attention_kernels,
    axcore_register_checkpoint_backends,
    axcore_register_commands,
    axcore_register_config_modifiers,
    axcore_register_data_sources,
    axcore_register_experiments,
    axcore_register_kernels,
    axcore_register_layers,
    axcore_register_mesh_rules,
    axcore_register_metrics_writers,
    axcore_register_model_converters,
    axcore_register_objectives,
    axcore_register_ops,
    axcore_register_optimizers,
    axcore_register_position_embeddings,
    axcore_register_schedules,
    axcore_register_tokenizers,
    axcore_runtime_environment,
    axcore_settings_config,
    axcore_transform_config,
    axcore_xla_flags,
)

__all__ = [
    "PLUGIN_API_VERSION",
    "KERNELS",
    "axcore_add_hookspecs",
    "axcore_register_layers",
    "axcore_register_position_embeddings",
    "axcore_register_attention_kernels",
    "axcore_register_ops",
    "axcore_register_kernels",
    "axcore_register_mesh_rules",
    "axcore_register_config_modifiers",
    "axcore_register_checkpoint_backends",
    "axcore_register_data_sources",
    "axcore_register_optimizers",
    "axcore_register_schedules",
    "axcore_register_objectives",
    "axcore_register_tokenizers",
    "axcore_register_metrics_writers",
    "axcore_register_experiments",
    "axcore_register_commands",
    "axcore_register_model_converters",
    "axcore_probe_instance_type",
    "axcore_xla_flags",
    "axcore_flags_environment",
    "axcore_runtime_environment",
    "axcore_settings_config",
    "axcore_transform_config",
]
