"""axcore: a plugin-based large-model training framework on JAX.

Public API; plugin authors need `hookimpl`, the config types, `Module` and the
layers they build on.
"""

from axcore.config import (
    REQUIRED,
    ConfigBase,
    Configurable,
    InstantiableConfig,
    config_for_class,
    config_for_function,
)
from axcore.errors import (
    AxcoreError,
    ConfigError,
    ConfigTypeError,
    DuplicateComponentError,
    KernelNotSupportedError,
    MissingRequiredError,
    NoMatchError,
    PluginError,
    PluginLoadError,
    PluginVersionError,
    UnknownComponentError,
    UnknownFieldError,
    UnknownPluginError,
)
from axcore.hookspecs import hookimpl, hookspec
from axcore.module import InvocationContext, Module, OutputCollection, functional
from axcore.params import ParameterSpec
from axcore.plugins import AxcorePluginManager, PluginRequest, create_plugin_manager
from axcore.registry import Registries, Registry

__version__ = "0.1.0"

__all__ = [
    "REQUIRED",
    "AxcoreError",
    "AxcorePluginManager",
    "ConfigBase",
    "ConfigError",
    "ConfigTypeError",
    "Configurable",
    "DuplicateComponentError",
    "InstantiableConfig",
    "InvocationContext",
    "KernelNotSupportedError",
    "MissingRequiredError",
    "Module",
    "NoMatchError",
    "OutputCollection",
    "ParameterSpec",
    "PluginError",
    "PluginLoadError",
    "PluginRequest",
    "PluginVersionError",
    "Registries",
    "Registry",
    "UnknownComponentError",
    "UnknownFieldError",
    "UnknownPluginError",
    "config_for_class",
    "config_for_function",
    "create_plugin_manager",
    "functional",
    "hookimpl",
    "hookspec",
]
