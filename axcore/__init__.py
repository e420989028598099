"""axcore: a plugin-based large-model training framework on JAX.

The public API is re-exported here lazily (PEP 562), so that `import axcore` (and
`axcore --help`) does not import JAX until a name that needs it is used.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "axcore.config": [
        "REQUIRED",
        "ConfigBase",
        "Configurable",
        "InstantiableConfig",
        "config_for_class",
        "config_for_function",
    ],
    "axcore.errors": [
        "AxcoreError",
        "ConfigError",
        "ConfigTypeError",
        "DuplicateComponentError",
        "KernelNotSupportedError",
        "MissingRequiredError",
        "NoMatchError",
        "PluginConflictError",
        "PluginError",
        "PluginLoadError",
        "PluginVersionError",
        "UnknownComponentError",
        "UnknownFieldError",
        "UnknownPluginError",
    ],
    "axcore.plugin.hookspecs": ["PLUGIN_API_VERSION"],
    "axcore.markers": ["hookimpl", "hookspec"],
    "axcore.module": ["InvocationContext", "Module", "OutputCollection", "functional"],
    "axcore.params": ["ParameterSpec"],
    "axcore.plugin.loading": ["AxcorePluginManager", "PluginRequest"],
    "axcore.experiment.builtins": ["create_plugin_manager"],
    "axcore.registry": ["Registries", "Registry"],
    "axcore.experiment.loading": ["Experiment", "ExperimentConfig", "load_experiment"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
