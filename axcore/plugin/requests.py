"""One entry of an experiment's `plugins:` list: a plugin name and an optional version specifier.

`PluginRequest.parse("my_feature>=0.2")` gives `PluginRequest("my_feature", ">=0.2")`;
anything but `NAME[SPECIFIER]` (extras, markers, URLs, a non-string) is a ConfigError
naming the entry. Parsing imports no plugin and reads no metadata; whether the named
plugin is installed, and in a matching version, is `axcore.plugin.loading`' job.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement

from axcore.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PluginRequest:
    """One `plugins:` entry: a name and an optional version specifier."""

    # The plugin's name: its entry-point name in the `axcore` group (or a name given to `objects=`).
    name: str
    # A PEP 440 version specifier the installed distribution must satisfy, e.g. ">=0.2"; "" for any.
    specifier: str = ""

    @classmethod
    def parse(cls, text: Any, where: str = "plugins") -> PluginRequest:
        """Parses `text` (e.g. "rope>=0.2"); `where` names the entry in errors (e.g. "plugins[1]").

        Raises:
            ConfigError: `text` is not a string of the form NAME[SPECIFIER].
        """
        if not isinstance(text, str):
            raise ConfigError(f"'{where}' entries must be plugin names, got {text!r}.")
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            raise ConfigError(
                f"'{where}' entry {text!r} is not a plugin name with an optional version "
                f"specifier (e.g. 'my_feature>=0.2'): {e}."
            ) from None
        if req.extras or req.marker or req.url:
            raise ConfigError(f"'{where}' entry {text!r}: only NAME[SPECIFIER] is allowed.")
        return cls(req.name, str(req.specifier))
