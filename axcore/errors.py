"""Error types raised for bad user input.

Every error a user can cause with a config, a plugin list, a checkpoint or a CLI
argument is a subclass of `AxcoreError`. Its message names the offending path,
plugin or file and says what to do; the CLI prints it as one line and exits 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def one_line(error: BaseException) -> str:
    """The error's message on one line (runs of whitespace, newlines included, become one space)."""
    return " ".join(str(error).split())

class AxcoreError(Exception):
    """Base class of every error caused by user input (configs, plugins, files)."""


class ConfigError(AxcoreError):
    """A config tree, YAML file or override is invalid."""


class UnknownFieldError(ConfigError, AttributeError):
    """A config has no field of the given name (the message suggests the closest)."""


class ConfigTypeError(ConfigError, TypeError):
    """A config field was given a value of the wrong type."""


class MissingRequiredError(ConfigError):
    """A required config field was never set."""


class NoMatchError(ConfigError):
    """A config replacement or transform matched nothing."""


class UnknownComponentError(ConfigError):
    """A config names a component (layer, kernel, ...) that no plugin registered.

    `name` is the unknown name and `family` the registry family it was looked up in
    (e.g. "tokenizers"), where known, so that the loader can name an installed plugin
    that registers it; `problem` is the message without its advice.
    """

    def __init__(self, message: str, *, name: str | None = None, family: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.name, self.family, self.problem = name, family, problem


class PluginError(AxcoreError):
    """A plugin is missing, broken, incompatible or conflicts with another."""


class UnknownPluginError(PluginError):
    """A `plugins:` entry names no installed plugin."""


class PluginVersionError(PluginError):
    """An installed plugin does not satisfy the version specifier asked for."""


class PluginLoadError(PluginError):
    """A plugin failed to import or violated a hook contract."""


class DuplicateComponentError(PluginError):
    """Two plugins registered a component under the same name."""


class PluginConflictError(PluginError):
    """Two enabled plugins' config transforms wrote the same config value."""


class KernelNotSupportedError(AxcoreError):
    """A kernel explicitly asked for declines the given problem."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Returns ' (did you mean X?)' for the closest candidate, or '' if none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
