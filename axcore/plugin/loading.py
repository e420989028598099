"""Building a plugin manager: built-ins, then entry-point plugins by name, then the hardware plugin.

`create_plugin_manager(["my_feature>=0.2", "other"])` builds a manager (there is no global
one): built-in plugins first, through the same hooks as third-party ones; then each
requested plugin, loaded from the `axcore` entry-point group *by name* (no other
entry point is imported); then, if a platform is given, the hardware plugin named
after it. Set AXCORE_DISABLE_PLUGIN_AUTOLOAD=1 to load only plugins named
explicitly (the escape hatch when an installed plugin is broken), and
AXCORE_LOAD_PLUGINS=rope,moe to let only the listed installed plugins load at all
(an empty value: none); plugins given as objects by code are not affected.

This module gathers the public names of the plugin kernel (`axcore.plugin` re-exports
them); the pieces live in modules of their own, one job each:
- `axcore.plugin.requests`: parsing a `plugins:` entry (`PluginRequest`);
- `axcore.plugin.entry_points`: discovery from distribution metadata, and the variables
  that restrict it (nothing imported);
- `axcore.plugin.manager`: `AxcorePluginManager` (order, provenance, registries,
  settings, transforms) and the plugin API requirement check;
- `axcore.plugin.flags`: merging the plugins' XLA flags and flags variable;
- `axcore.plugin.instance_probe`: the instance type, probed before JAX starts.
`axcore.cli.plugins.describe_plugins` is what `axcore plugins` shows.

Why not pluggy's `load_setuptools_entrypoints(group, name=...)` and `set_blocked`:
loading by name is what pluggy offers too, but it rescans every distribution on
each call (ours reuses one scan while `sys.path` is unchanged), registers the
plugin itself (bypassing the API requirement check, the refusal of `tryfirst` and
wrappers and `axcore_add_hookspecs`, done in `AxcorePluginManager.register_plugin`),
silently keeps the first of two distributions providing one name (ours is an error
naming both), matches only the exact name (ours also tries the PEP 503 normalised
one), checks no version specifier before importing, and lets an import error escape
without naming the distribution. pluggy's blocking is a per-manager deny list of names that would also
block objects given by code; AXCORE_LOAD_PLUGINS is an allow list over installed
entry points only, applied where they are scanned (`axcore.plugin.entry_points`), so the
CLI listing, the instance probe and lookups by name all honour it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from axcore.errors import (
    ConfigError,
    PluginError,
    PluginLoadError,
    PluginVersionError,
    UnknownPluginError,
    did_you_mean,
)
from axcore.plugin.entry_points import (  # Re-exported: discovery reads metadata only (axcore/plugin/entry_points.py).
    DISABLE_AUTOLOAD_ENV,
    ENTRY_POINT_GROUP,
    LOAD_PLUGINS_ENV,
    allowed_to_load,
    autoload_disabled,
    distribution_of,
    excluded_entry_points,
    installed_entry_points,
    installed_plugins,
    load_allow_list,
)
from axcore.plugin.instance_probe import HARDWARE_PLATFORMS, probe_instance_type  # Re-exported: the pre-JAX probe.
from axcore.plugin.manager import (  # Re-exported: the manager and what it records (axcore/plugin/manager.py).
    API_REQUIREMENT_ATTRIBUTE,
    BUILTIN_DISTRIBUTION,
    AxcorePluginManager,
    Component,
    PluginInfo,
    UnknownHookError,
    _core_version,
)
from axcore.plugin.requests import PluginRequest  # Re-exported: parsing `plugins:` entries.
from axcore.registry import Registries

__all__ = [
    "API_REQUIREMENT_ATTRIBUTE",
    "BUILTIN_DISTRIBUTION",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "HARDWARE_PLATFORMS",
    "LOAD_PLUGINS_ENV",
    "AxcorePluginManager",
    "Component",
    "PluginExcludedError",
    "PluginInfo",
    "PluginRequest",
    "UnknownHookError",
    "allowed_to_load",
    "autoload_disabled",
    "builtin_registries",
    "component_plugins",
    "create_plugin_manager",
    "distribution_of",
    "excluded_entry_points",
    "installed_entry_points",
    "installed_plugins",
    "load_allow_list",
    "load_plugin",
    "probe_instance_type",
]

def component_plugins() -> dict[str, ModuleType]:
    """The built-in plugins of the component packages below this layer: registered name -> module, in order.

    The layers above own the whole list and pass it down (`axcore.experiment.builtins`, which
    adds the experiment layer's config modifiers), as pytest's config owns its default
    plugins; a manager built here without `builtins=` gets these. The names are the
    built-ins' stable names (the provenance configs and `axcore plugins` show): the
    platform's plugin keeps `axcore.platform.mesh`.
    """
    from axcore.checkpoint import plugin as checkpoint  # Deferred: imported when a manager is built.
    from axcore.data import plugin as data
    from axcore.experiments import plugin as experiments
    from axcore.kernels import plugin as kernels
    from axcore.layers import plugin as layers
    from axcore.learning import plugin as learning
    from axcore.observe import plugin as observe
    from axcore.platform import plugin as platform
    from axcore.trainer import plugin as trainer

    return {
        "axcore.layers.plugin": layers,
        "axcore.kernels.plugin": kernels,
        "axcore.platform.mesh": platform,
        "axcore.data.plugin": data,
        "axcore.checkpoint.plugin": checkpoint,
        "axcore.learning.plugin": learning,
        "axcore.trainer.plugin": trainer,
        "axcore.observe.plugin": observe,
        "axcore.experiments.plugin": experiments,
    }


class PluginExcludedError(UnknownPluginError):
    """A `plugins:` entry names an installed plugin that AXCORE_LOAD_PLUGINS leaves out."""


def builtin_registries() -> Registries:
    """Registries of a manager with only the component built-ins (`component_plugins()`)."""
    return create_plugin_manager().registries


def load_plugin(name: str, eps: Sequence[importlib.metadata.EntryPoint] | None = None) -> tuple[Any, str, str]:
    """Imports installed plugin `name` from its entry points; returns (plugin, distribution, version).

    `eps` defaults to the entry points `installed_plugins()` finds under `name`. The plugin
    is only imported, not registered (`AxcorePluginManager.register_plugin` does that).

    Raises:
        UnknownPluginError: no installed plugin has that name.
        PluginError: several distributions provide the name.
        PluginLoadError: the import fails (the message names the distribution and the fixes).
    """
    if eps is None:
        eps = installed_plugins().get(name, [])
        if not eps:
            raise UnknownPluginError(f"No installed plugin named '{name}'; `axcore plugins` lists them.")
    if len(eps) > 1:
        dists = ", ".join(distribution_of(ep)[0] for ep in eps)
        raise PluginError(f"Plugin name '{name}' is provided by several distributions ({dists}); uninstall all but one.")
    ep = eps[0]
    dist, version = distribution_of(ep)
    try:
        plugin = ep.load()
    except Exception as e:  # Any import failure inside the plugin is reported, not swallowed.
        raise PluginLoadError(
            f"Plugin '{name}' (distribution {dist}) failed to import: {type(e).__name__}: {e}. "
            f"Remove it from `plugins:`, uninstall it (pip uninstall {dist}), or set "
            f"{DISABLE_AUTOLOAD_ENV}=1 if it is loaded automatically."
        ) from e
    return plugin, dist, version


def create_plugin_manager(
    plugins: Sequence[str] = (),
    *,
    objects: Mapping[str, Any] | None = None,
    platform: str | None = None,
    builtins: Mapping[str, ModuleType] | None = None,
) -> AxcorePluginManager:
    """Builds a plugin manager.

    Args:
        plugins: the experiment's `plugins:` list, e.g. `["my_feature>=0.2", "other"]`, enabled
            in this order.
        objects: plugin objects registered directly by code, by name; a requested name
            is looked up here before the entry points.
        platform: the detected platform ("gpu", "tpu", ...); the entry point of that
            name is loaded too unless AXCORE_DISABLE_PLUGIN_AUTOLOAD is set.
        builtins: the built-in plugins, name -> module, registered first in this order;
            default `component_plugins()`. `axcore.create_plugin_manager` passes all of
            axcore's (`axcore.experiment.builtins.builtin_plugins()`).

    Raises:
        UnknownPluginError: a requested name is neither given nor installed (the
            message lists the installed names).
        PluginVersionError: an installed version does not satisfy the specifier.
        PluginLoadError: a plugin fails to import or has invalid hook implementations.
    """
    manager = AxcorePluginManager()
    for module_name, module in (component_plugins() if builtins is None else builtins).items():
        manager.register_plugin(module, module_name, distribution=BUILTIN_DISTRIBUTION, version=_core_version(), source="builtin")
    objects = dict(objects or {})
    requests = [PluginRequest.parse(p, f"plugins[{i}]") for i, p in enumerate(plugins)]
    names = [r.name for r in requests]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"'plugins' lists {', '.join(dupes)} more than once; list each plugin once.")
    entry_points: dict[str, list] | None = None
    for request in requests:
        if request.name in objects:
            manager.register_plugin(objects[request.name], request.name)
            continue
        if entry_points is None:
            entry_points = installed_entry_points()
        eps = entry_points.get(request.name) or entry_points.get(canonicalize_name(request.name))
        if not eps and not allowed_to_load(request.name):
            excluded = excluded_entry_points()
            if request.name in excluded or canonicalize_name(request.name) in excluded:
                raise PluginExcludedError(
                    f"Plugin '{request.name}' in `plugins:` is installed, but {LOAD_PLUGINS_ENV}="
                    f"{os.environ.get(LOAD_PLUGINS_ENV, '')!r} leaves it out; add it to {LOAD_PLUGINS_ENV}, unset "
                    f"the variable, or remove it from `plugins:`."
                )
        if not eps:
            installed = sorted(set(entry_points) | set(objects))
            raise UnknownPluginError(
                f"Unknown plugin '{request.name}' in `plugins:`{did_you_mean(request.name, installed)}; "
                f"installed plugins: {', '.join(installed) or 'none'}. Install its package "
                f"(e.g. pip install axcore-{request.name}) or fix the name."
            )
        dist, version = distribution_of(eps[0])
        if request.specifier and not SpecifierSet(request.specifier).contains(version, prereleases=True):
            raise PluginVersionError(
                f"Plugin '{request.name}' {request.specifier} was asked for, but {dist} {version} "
                f"is installed; install a matching version or relax the specifier."
            )
        plugin, dist, version = load_plugin(request.name, eps)
        manager.register_plugin(plugin, request.name, distribution=dist, version=version, source="entry-point")
    if platform and platform in objects and not manager.is_registered(platform):
        # Given as an object (tests, notebooks): registered as an autoloaded hardware plugin would be.
        manager.register_plugin(objects[platform], platform, source="platform", listed=False)
    if platform and not autoload_disabled() and not manager.is_registered(platform):
        if entry_points is None:
            entry_points = installed_entry_points()
        if platform in entry_points:
            plugin, dist, version = load_plugin(platform, entry_points[platform])
            # Registers kernels and mesh rules; its transforms run only if `plugins:` lists it.
            manager.register_plugin(
                plugin, platform, distribution=dist, version=version, source="platform", listed=False
            )
    manager.check_pending()
    return manager
