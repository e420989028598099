"""XLA flags: what plugins recommend per instance type, what the experiment overrides, and
setting them before JAX's backend starts.

Precedence, lowest first:

1. plugins' `axcore_xla_flags(instance_type)` answers (two plugins disagreeing on a flag
   is an error naming both);
2. the experiment's `xla_flags:` map (`{flag: value}`, names without `--`; a null value
   removes a plugin's flag);
3. flags already in the `XLA_FLAGS` environment variable, which `apply_xla_flags` never
   overrides.

XLA reads `XLA_FLAGS` once, when the first backend starts, so flags only take effect if
they are set before that. `load_experiment(..., apply_xla_flags=True)` (what `axcore
train` and `axcore compile` do) therefore asks the installed plugins which machine this
is through `axcore_probe_instance_type`, which must not start JAX, and sets the flags
before anything asks JAX for a device. When no plugin can tell (and JAX_PLATFORMS is
unset), the backend is started to ask JAX, and flags that were not already in the
environment are reported as not applied.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

from axcore.errors import ConfigError

# A flag name as XLA spells it, without the leading `--` (e.g. xla_gpu_enable_command_buffer).
_FLAG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def flag_value(value: Any, where: str) -> str:
    """The XLA_FLAGS spelling of a YAML value: booleans as true/false, numbers as written.

    Raises:
        ConfigError: naming `where` for a value that is not a scalar or that contains whitespace.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        text = str(value)
        if re.search(r"\s", text):
            raise ConfigError(f"{where}: value {text!r} contains whitespace, which XLA_FLAGS cannot carry.")
        return text
    raise ConfigError(f"{where}: value {value!r} must be a string, number or boolean (null removes the flag).")


def check_flag_name(name: Any, where: str) -> str:
    """`name` if it is a flag name without `--`; raises ConfigError naming `where` otherwise."""
    if not isinstance(name, str) or not _FLAG_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {name!r} is not an XLA flag name; write it without the leading '--' and "
            f"without '=' (e.g. xla_gpu_enable_latency_hiding_scheduler: true)."
        )
    return name


def resolve_xla_flags(recommended: Mapping[str, str], overrides: Mapping[str, Any], path: str = "xla_flags") -> dict[str, str]:
    """`recommended` (the plugins') updated by the experiment's `overrides`; None values remove.

    Returns `{flag: value}` sorted by flag name, values as strings.

    Raises:
        ConfigError: naming `<path>.<flag>` for a malformed name or value.
    """
    flags = dict(recommended)
    for name, value in overrides.items():
        where = f"{path}.{name}"
        check_flag_name(name, where)
        if value is None:
            flags.pop(name, None)
        else:
            flags[name] = flag_value(value, where)
    return dict(sorted(flags.items()))


# Variables XLA itself parses: an empty value is written `--name=` (XLA needs the `=`); other
# compilers' variables (e.g. NEURON_CC_FLAGS) get a bare `--name` switch for an empty value.
XLA_STYLE_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def format_xla_flags(flags: Mapping[str, str], variable: str = "XLA_FLAGS") -> str:
    """`--name=value` tokens joined by spaces, in the mapping's order (`--name` for an empty value
    when `variable` is not one XLA parses)."""
    bare = variable not in XLA_STYLE_VARIABLES
    return " ".join(f"--{name}" if bare and value == "" else f"--{name}={value}" for name, value in flags.items())


def _environment_flags(text: str) -> dict[str, str]:
    """`{name: value}` of an XLA_FLAGS string's `--name[=value]` tokens."""
    found = {}
    for token in text.split():
        name, _, value = token.removeprefix("--").partition("=")
        found[name] = value
    return found


def apply_xla_flags(
    flags: Mapping[str, str], environ: MutableMapping[str, str] = os.environ, variable: str = "XLA_FLAGS"
) -> dict[str, str]:
    """Adds `flags` to `environ[variable]` (XLA_FLAGS, or e.g. LIBTPU_INIT_ARGS), keeping every flag already there.

    Must run before JAX's backend starts; afterwards XLA never reads the variable again.

    Returns the flags that were added (those the environment already named are left out).
    """
    current = environ.get(variable, "")
    present = _environment_flags(current)
    added = {name: value for name, value in flags.items() if name not in present}
    if added:
        environ[variable] = " ".join(filter(None, [current.strip(), format_xla_flags(added, variable)]))
    return added


def apply_runtime_environment(
    values: Mapping[str, str], environ: MutableMapping[str, str] = os.environ
) -> dict[str, str]:
    """Sets each of `values` (`axcore_runtime_environment` answers) that `environ` lacks.

    Must run before JAX's backend starts (the CUDA driver, say, reads its variables once).
    Returns the variables that were set; one already in the environment is never changed.
    """
    added = {name: value for name, value in values.items() if name not in environ}
    environ.update(added)
    return added


__all__ = [
    "apply_runtime_environment",
    "apply_xla_flags",
    "check_flag_name",
    "flag_value",
    "format_xla_flags",
    "resolve_xla_flags",
]
