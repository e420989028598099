"""Merging what plugins answer about compiler flags and the runtime's environment:
`axcore_xla_flags`, `axcore_flags_environment` and `axcore_runtime_environment`.

The plugin manager calls the hooks, one enabled plugin at a time in its order, and
hands the answers here as `(plugin name, distribution, answer)` triples; these
functions only merge them, so a conflict is reported naming both plugins whatever
the order. The experiment's own `xla_flags:` and the XLA_FLAGS environment variable
are applied on top later (`axcore.platform.xla_flags.resolve_xla_flags`, `apply_xla_flags`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from axcore.errors import ConfigError, PluginConflictError, PluginLoadError
from axcore.platform.xla_flags import check_flag_name, flag_value

# The variable carrying XLA's flags when no plugin names another.
DEFAULT_FLAGS_ENVIRONMENT = "XLA_FLAGS"
# An environment variable's name as plugins may set it.
_ENVIRONMENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def merge_xla_flags(answers: Iterable[tuple[str, str, Any]]) -> dict[str, str]:
    """Merges plugins' `axcore_xla_flags` answers into `{flag: value}`, values as strings.

    Args:
        answers: `(plugin name, distribution, answer)` in plugin order; an answer is a
            mapping of flag name (without `--`) to value. None answers are left out by
            pluggy before they get here.

    Raises:
        PluginConflictError: two plugins give one flag different values (naming both).
        PluginLoadError: an answer is not a mapping of flags.
        ConfigError: a flag name or value is malformed (naming the flag and plugin).
    """
    return _merge_named_values(answers, "axcore_xla_flags", "flag", check_flag_name,
                               "choose one in the experiment's xla_flags")


def merge_runtime_environment(answers: Iterable[tuple[str, str, Any]]) -> dict[str, str]:
    """Merges plugins' `axcore_runtime_environment` answers into `{VARIABLE: value}`.

    Args:
        answers: `(plugin name, distribution, answer)` in plugin order; an answer maps
            environment variable names to values.

    Raises:
        PluginConflictError: two plugins give one variable different values (naming both).
        PluginLoadError: an answer is not a mapping.
        ConfigError: a variable name or value is malformed (naming it and the plugin).
    """
    return _merge_named_values(answers, "axcore_runtime_environment", "environment variable",
                               check_environment_name, "set the variable yourself to choose")


def check_environment_name(name: Any, where: str) -> str:
    """`name` if it is an environment variable name (letters, digits, underscores)."""
    if not isinstance(name, str) or not _ENVIRONMENT_NAME.fullmatch(name):
        raise ConfigError(f"{where}: {name!r} is not an environment variable name (letters, digits and '_').")
    return name


def _merge_named_values(answers, hook: str, kind: str, check_name, remedy: str) -> dict[str, str]:
    """`{name: value}` of every answer; one name with two values is a conflict naming both plugins."""
    merged: dict[str, str] = {}
    owners: dict[str, str] = {}
    for plugin, distribution, answer in answers:
        if not isinstance(answer, Mapping):
            raise PluginLoadError(
                f"Plugin '{plugin}' ({distribution}): {hook} returned "
                f"{type(answer).__name__}; return a dict of name -> value, or None."
            )
        for name, value in answer.items():
            where = f"{kind} {name} of plugin '{plugin}'"
            value = flag_value(value, where)
            name = check_name(name, where)
            if name in merged and merged[name] != value:
                raise PluginConflictError(
                    f"Plugins '{owners[name]}' and '{plugin}' set {'XLA ' if kind == 'flag' else ''}{kind} {name} "
                    f"to {merged[name]!r} and {value!r}; {remedy}."
                )
            merged[name] = value
            owners.setdefault(name, plugin)
    return merged


def choose_flags_environment(answers: Iterable[tuple[str, Any]], instance_type: str) -> str:
    """The one variable plugins name for `instance_type`'s compiler flags, else XLA_FLAGS.

    Args:
        answers: `(plugin name, answer)` of `axcore_flags_environment`, in plugin order.
        instance_type: the run's instance type, for the error message.

    Raises:
        PluginConflictError: two plugins name different variables (naming both).
    """
    chosen: tuple[str, str] | None = None
    for plugin, name in answers:
        if chosen is not None and chosen[1] != name:
            raise PluginConflictError(
                f"Plugins '{chosen[0]}' and '{plugin}' want the compiler flags of {instance_type} in "
                f"{chosen[1]} and {name}; uninstall or unlist one of them."
            )
        chosen = (plugin, str(name))
    return chosen[1] if chosen else DEFAULT_FLAGS_ENVIRONMENT
