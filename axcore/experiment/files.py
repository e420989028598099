"""Finding and reading experiment files: a path, or a name shipped by a built-in or installed plugin.

`read_experiment_file` returns the raw YAML mapping (read with the hardened safe
loader) and a label that error messages name; `search_plugins` is the search it
uses, also what `axcore plugins`, model converters and `with_plugin_hint` (an unknown
component name's error naming the plugin to enable) use to find a family's
registrations among plugins that are not enabled.

Layer: experiment (imports config, registry and the plugin manager; never the loader).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from axcore.config.safe_yaml import read_file as read_yaml_file
from axcore.config.serialize import safe_load
from axcore.errors import ConfigError, PluginError, UnknownComponentError, did_you_mean
from axcore.experiment.builtins import create_plugin_manager
from axcore.experiments import experiment_text
from axcore.placement.layout import CONFIG_FILE
from axcore.plugin.loading import BUILTIN_DISTRIBUTION, autoload_disabled, installed_entry_points
from axcore.plugin.requests import PluginRequest
from axcore.registry import Registration, Registry


@dataclasses.dataclass
class SearchResult:
    """Registrations of one family found among built-in, given and installed plugins."""

    # Name -> registration.
    found: dict[str, Registration]
    # Plugin -> why it could not be searched (it failed to load or to register).
    broken: dict[str, str]


def _builtin_registry(family: str) -> Registry:
    """Family `family` of a manager with only the built-in plugins."""
    return create_plugin_manager().registries.family(family)


def search_plugins(
    family: str, *, objects: Mapping[str, Any] | None = None, installed: bool = True, name: str | None = None
) -> SearchResult:
    """What the built-in plugins, the plugins given as `objects` and installed plugins register in `family`.

    Searched in that order; with `name`, the search stops at the first of the three
    that provides it (so a built-in name loads no plugin). Each plugin is loaded on
    its own, with the built-ins, so plugins that could never be enabled together do
    not conflict and a broken one is reported in `broken` instead of stopping the
    search. Installed plugins are searched unless `installed` is False or
    AXCORE_DISABLE_PLUGIN_AUTOLOAD is set. Names follow the usual rule: one name from
    two places is an error naming both, unless exactly one says override=True.

    Raises:
        DuplicateComponentError: one name from two places, neither overriding the other.
    """
    builtin = _builtin_registry(family)
    merged: Registry = Registry(builtin.kind)
    for n in builtin:
        entry = builtin.entry(n)
        merged.register(n, entry.value, entry.provenance, entry.override)
    broken: dict[str, str] = {}
    objects = dict(objects or {})
    phases = [sorted(objects)]
    if installed and not autoload_disabled():
        phases.append(sorted(set(installed_entry_points()) - set(objects)))
    for plugins in phases:
        if name is not None and name in merged:
            break
        for plugin in plugins:
            try:
                registry = create_plugin_manager([plugin], objects=objects).registries.family(family)
            except PluginError as e:
                broken[plugin] = " ".join(str(e).split())
                continue
            for n in registry:
                entry = registry.entry(n)
                if entry.provenance.plugin == plugin:
                    merged.register(n, entry.value, entry.provenance, entry.override)
    return SearchResult({n: merged.entry(n) for n in merged}, broken)


def with_plugin_hint(error: ConfigError, enabled: list[str], objects: dict[str, Any] | None) -> ConfigError:
    """`error`, or for an unknown component name of a known family that an installed plugin not in `enabled`
    registers, an error saying which plugin to add to `plugins:` (`search_plugins` loads each installed
    plugin on its own to ask; only on this error's path)."""
    if not isinstance(error, UnknownComponentError) or not error.family or not error.problem:
        return error
    entry = search_plugins(error.family, objects=objects, name=error.name).found.get(error.name)
    if entry is None or entry.provenance.plugin in enabled:
        return UnknownComponentError(
            f"{error.problem} No installed plugin registers it; install the plugin that provides it and add it to "
            f"`plugins:`.", name=error.name, family=error.family, problem=error.problem,
        )
    plugin = entry.provenance.plugin
    return UnknownComponentError(
        f"{error.problem} Plugin '{plugin}' (distribution {entry.provenance.distribution}) registers it: add "
        f"`{plugin}` to plugins:.", name=error.name, family=error.family, problem=error.problem,
    )


def builtin_experiments() -> list[str]:
    """Names of the experiments the built-in plugins ship (axcore/experiments/*.yaml)."""
    return _builtin_registry("experiments").names()


def _looks_like_path(source: str) -> bool:
    return os.sep in source or "/" in source or source.endswith((".yaml", ".yml"))


def read_experiment_file(
    source: str | os.PathLike | None, *, objects: Mapping[str, Any] | None = None
) -> tuple[dict, str]:
    """Raw YAML mapping of a file path or a registered experiment name (None = "default").

    A name is looked up among the built-in plugins, then `objects`, then installed
    plugins (see `search_plugins`; a path-like name searches no installed plugin);
    the experiment's own `plugins:` list decides which plugins it enables.
    """
    source = "default" if source is None else os.fspath(source)
    if os.path.isfile(source):
        text, label = read_yaml_file(source), source  # Bytes, at most the YAML size limit.
    else:
        search = search_plugins("experiments", objects=objects, installed=not _looks_like_path(source), name=source)
        entry = search.found.get(source)
        if entry is None:
            raise ConfigError(_unknown_experiment(source, search))
        value = entry.value
        text = value.read_bytes() if callable(getattr(value, "read_bytes", None)) else experiment_text(value)
        if entry.provenance.distribution == BUILTIN_DISTRIBUTION:
            label = f"<built-in experiment {source}>"
        else:
            label = f"<experiment {source} of {entry.provenance}>"
    data = safe_load(text, label=label)  # Hardened: one-line ConfigError naming `label`.
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: an experiment file must be a mapping, got {type(data).__name__}.")
    return data, label


def _unknown_experiment(source: str, search: SearchResult) -> str:
    available = [
        name if entry.provenance.distribution == BUILTIN_DISTRIBUTION else f"{name} (plugin {entry.provenance.plugin})"
        for name, entry in sorted(search.found.items())
    ]
    message = (
        f"Experiment '{source}' is neither a file nor a built-in experiment{did_you_mean(source, search.found)}; "
        f"available: {', '.join(available) or 'none'}. Check the path, or install the plugin that ships it."
    )
    if search.broken:
        message += f" Plugins that could not be searched: {', '.join(sorted(search.broken))} (see 'axcore plugins')."
    return message


# Keys of a base run's experiment that never carry over to the run fine-tuned from it: its own
# name and run directory (the new run must not write into the base), and its own base.
_NOT_INHERITED = {"name": None, "init_from": None, "trainer": ("run_dir",)}


def merge_onto_base_run(raw: dict, base: str, label: str, *, drop: Sequence[str] = ()) -> dict:
    """`raw` (an experiment mapping whose `init_from` is `base`) merged onto the experiment of run `base`.

    The base run's experiment is its `experiment.yaml` (what `axcore convert hf-to-axcore`
    writes: the architecture, to edit) if it has one, else its saved `config.yaml`, less
    the top-level keys `drop` (the loader passes the `resolved_by` marker: the merged
    experiment is resolved again) and less its `name`, `init_from` and `trainer.run_dir`.
    Then `raw` is merged on top key by key (nested mappings merge; any other value
    replaces, and so does a mapping whose `type` names another component, such as the
    chat source over the base's text source), except `plugins`: the base's list, then
    `raw`'s entries the base does not list (by plugin name), in order.

    Raises:
        ConfigError: `base` is not a directory holding experiment.yaml or config.yaml,
            naming `label` and `init_from`.
    """
    directory = os.path.expanduser(os.fspath(base))
    for file_name in ("experiment.yaml", CONFIG_FILE):
        path = os.path.join(directory, file_name)
        if os.path.isfile(path):
            break
    else:
        raise ConfigError(
            f"{label}: init_from '{base}' is not a run directory (it holds neither experiment.yaml nor config.yaml); "
            f"point it at a run written by axcore train or axcore convert hf-to-axcore."
        )
    merged, _ = read_experiment_file(path)
    for key in drop:
        merged.pop(key, None)
    for key, inner in _NOT_INHERITED.items():
        if inner is None:
            merged.pop(key, None)
        elif isinstance(merged.get(key), dict):
            for name in inner:
                merged[key].pop(name, None)
    plugins = list(merged.get("plugins") or [])
    names = {PluginRequest.parse(p).name for p in plugins}
    plugins += [p for p in raw.get("plugins") or [] if PluginRequest.parse(p).name not in names]
    _merge_components(merged, {k: v for k, v in raw.items() if k != "plugins"})
    merged["plugins"] = plugins
    return merged


def _merge_components(into: dict, update: dict) -> None:
    """`deep_merge`, except that a mapping naming another `type` than `into`'s replaces it (another component)."""
    for key, value in update.items():
        old = into.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("type", old.get("type")) == old.get("type"):
            _merge_components(old, value)
        else:
            into[key] = value
