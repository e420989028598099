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

import hashlib
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from axcore.errors import ConfigError

logger = logging.getLogger(__name__)

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


# What the probe runs: XLA parses XLA_FLAGS when its first backend starts (a CPU one here, touching no accelerator).
_PROBE = "import jax; jax.devices()"
# Seconds the probe may take (a machine under load starts JAX in a few seconds).
_PROBE_TIMEOUT_S = 120
# XLA's two fatal lines about XLA_FLAGS: a name no flag list knows, a value its flag's type cannot hold.
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (\S+)")
_BAD_VALUE = re.compile(r"Couldn't interpret value (.*) for flag (\S+?)\.?$", re.MULTILINE)
# A flag's line in XLA's usage text: `--name=default<TAB>type<TAB>description`.
_USAGE = re.compile(r"^\s*--([A-Za-z0-9_]+)=\S*\s+(bool|int32|int64|float|string)\b", re.MULTILINE)


def _probe_cache_file(flags_text: str) -> pathlib.Path:
    """Where the verdict on `flags_text` for the installed jaxlib is kept (one small JSON file per flag set)."""
    import jaxlib  # The version only: importing jaxlib starts no backend.

    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "axcore" / "xla_flags"
    key = hashlib.sha256(f"{sys.executable}\n{jaxlib.__version__}\n{flags_text}".encode()).hexdigest()[:32]
    return root / f"{key}.json"


def _run_probe(flags_text: str) -> str | None:
    """XLA's complaint about XLA_FLAGS=`flags_text` (its stderr) from a fresh CPU-only process, "" if it
    accepted them, None if the probe itself could not run (it then decides nothing)."""
    env = {**os.environ, "XLA_FLAGS": flags_text, "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("XLA flags not checked: the probe process failed (%s).", e)
        return None
    if done.returncode == 0:
        return ""
    if _UNKNOWN.search(done.stderr) or _BAD_VALUE.search(done.stderr):
        return done.stderr
    logger.warning("XLA flags not checked: the probe process exited %d (%s).", done.returncode,
                   (done.stderr.strip().splitlines() or ["no output"])[-1][:300])
    return None


def _probe(flags_text: str) -> str | None:
    """`_run_probe`, its verdict cached on disk per jaxlib version and flag set (a run's next start reads it)."""
    cache = _probe_cache_file(flags_text)
    try:
        return json.loads(cache.read_text("utf-8"))["stderr"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    verdict = _run_probe(flags_text)
    if verdict is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"flags": flags_text, "stderr": verdict}), "utf-8")
            os.replace(tmp, cache)
        except OSError:  # An unwritable cache costs a probe next time, nothing else.
            pass
    return verdict


def check_xla_flags(flags: Mapping[str, str], variable: str = "XLA_FLAGS", path: str = "xla_flags") -> None:
    """Raises ConfigError naming `<path>.<flag>` if the installed XLA refuses a flag of `flags`.

    Only flags for XLA_FLAGS are checked (other variables go to other compilers). XLA
    knows its flags only once a backend parses them, and an unknown name or a value
    its flag's type cannot hold aborts the process with a fatal C++ line (a bad boolean
    also prints the usage of every flag), so a separate CPU-only process starts XLA with
    the flags and its stderr is read (`_run_probe`, a few seconds; the verdict is cached
    per jaxlib version and flag set under $XDG_CACHE_HOME/axcore/xla_flags). XLA stops
    at the first bad flag, so one is named. If the probe cannot run, a warning says so
    and nothing is refused.
    """
    if variable != "XLA_FLAGS" or not flags:
        return
    text = format_xla_flags(dict(sorted(flags.items())), variable)
    stderr = _probe(text)
    if not stderr:
        return
    unknown, bad = _UNKNOWN.search(stderr), _BAD_VALUE.search(stderr)
    if unknown:
        name = unknown[1].removeprefix("--").split("=", 1)[0]
        raise ConfigError(
            f"'{path}.{name}' is not a flag the installed XLA (jaxlib) knows; check its spelling or remove it "
            f"(XLA would abort at start-up)."
        )
    value, name = bad[1], bad[2]
    kind = dict(_USAGE.findall(stderr)).get(name)
    raise ConfigError(
        f"'{path}.{name}': XLA cannot read {value!r} as the value of this flag"
        f"{f' (type {kind})' if kind else ''}; {'use true or false' if kind == 'bool' else 'fix the value'}."
    )


__all__ = [
    "apply_runtime_environment",
    "apply_xla_flags",
    "check_flag_name",
    "check_xla_flags",
    "flag_value",
    "format_xla_flags",
    "resolve_xla_flags",
]
