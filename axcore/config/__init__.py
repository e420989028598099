"""Typed config trees: declaration, traversal and replacement, YAML, flat dumps, overrides."""

from axcore.config.base import (
    REQUIRED,
    CallableConfig,
    ClassConfig,
    ConfigBase,
    Configurable,
    DType,
    InstantiableConfig,
    config_for_class,
    config_for_function,
    default_config_for,
)
from axcore.config.serialize import (
    Resolver,
    apply_overrides,
    dump_flat,
    flatten,
    from_dict,
    from_yaml,
    parse_override,
    to_dict,
    to_yaml,
)
from axcore.config.traversal import find, get_path, is_config_of, remove, replace, walk

__all__ = [
    "REQUIRED",
    "CallableConfig",
    "ClassConfig",
    "ConfigBase",
    "Configurable",
    "DType",
    "InstantiableConfig",
    "Resolver",
    "apply_overrides",
    "config_for_class",
    "config_for_function",
    "default_config_for",
    "dump_flat",
    "find",
    "flatten",
    "from_dict",
    "from_yaml",
    "get_path",
    "is_config_of",
    "parse_override",
    "remove",
    "replace",
    "to_dict",
    "to_yaml",
    "walk",
]
