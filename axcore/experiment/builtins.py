"""axcore's built-in plugins, owned here and passed down to the plugin kernel (as pytest's config owns its default plugins).

The experiment layer is the lowest that holds every built-in: the component packages'
(`axcore.plugin.loading.component_plugins`) and its own config modifiers
(`config_modifiers`, `context_modifiers`). `create_plugin_manager` here is
`axcore.create_plugin_manager`: the kernel's, given this list, so import-linter sees
every built-in as an import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from axcore.experiment import config_modifiers, context_modifiers
from axcore.plugin import loading
from axcore.plugin.manager import AxcorePluginManager
from axcore.registry import Registries

__all__ = ["builtin_plugins", "builtin_registries", "create_plugin_manager"]


def builtin_plugins() -> dict[str, ModuleType]:
    """Every built-in plugin: registered name -> module, in registration order (the modifiers after the platform's)."""
    out: dict[str, ModuleType] = {}
    for name, module in loading.component_plugins().items():
        out[name] = module
        if name == "axcore.platform.mesh":
            out["axcore.experiment.config_modifiers"] = config_modifiers
            out["axcore.experiment.context_modifiers"] = context_modifiers
    return out


def create_plugin_manager(
    plugins: Sequence[str] = (), *, objects: Mapping[str, Any] | None = None, platform: str | None = None
) -> AxcorePluginManager:
    """A plugin manager with every built-in, then `plugins` (see `axcore.plugin.loading.create_plugin_manager`)."""
    return loading.create_plugin_manager(plugins, objects=objects, platform=platform, builtins=builtin_plugins())


def builtin_registries() -> Registries:
    """Registries of a manager with only the built-in plugins."""
    return create_plugin_manager().registries
