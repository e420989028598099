"""`axcore plugins`: what each installed (and built-in) plugin is, implements and registers.

`describe_plugins` loads each plugin on its own (with the built-ins) so that plugins
that could never be enabled together, or a broken one, can still be listed;
`plugins_json` is the `--json` form (keys: `PLUGIN_JSON_KEYS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from packaging.utils import canonicalize_name

from axcore.errors import PluginError, did_you_mean, one_line
from axcore.experiment.builtins import create_plugin_manager
from axcore.plugin import hookspecs
from axcore.plugin.loading import (
    API_REQUIREMENT_ATTRIBUTE,
    DISABLE_AUTOLOAD_ENV,
    LOAD_PLUGINS_ENV,
    AxcorePluginManager,
    Component,
    PluginRequest,
    UnknownHookError,
    allowed_to_load,
    autoload_disabled,
    distribution_of,
    installed_plugins,
    load_allow_list,
    load_plugin,
)

# Keys of one plugin in `axcore plugins --json` (`PluginDescription.to_json`).
PLUGIN_JSON_KEYS = (
    "name", "distribution", "version", "source", "enabled", "status", "detail", "plugin_api", "hooks", "components",
)


@dataclasses.dataclass(frozen=True)
class PluginDescription:
    """One plugin as `axcore plugins` shows it."""

    name: str
    distribution: str
    version: str
    # "builtin", "entry-point" (installed) or "object" (given by code).
    source: str
    # Built-ins always; other plugins when the experiment's `plugins:` lists them.
    enabled: bool
    # "ok"; "broken" (fails to import or register); "not-imported" (autoloading disabled);
    # "excluded" (AXCORE_LOAD_PLUGINS leaves it out).
    status: str = "ok"
    # Why it is not "ok" (one line), else "".
    detail: str = ""
    # Its AXCORE_PLUGIN_API requirement, or None.
    plugin_api: str | None = None
    # Hooks it implements, sorted.
    hooks: tuple[str, ...] = ()
    # What its registration hooks register, sorted by family and name.
    components: tuple[Component, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = {key: getattr(self, key) for key in PLUGIN_JSON_KEYS}
        data["hooks"] = list(self.hooks)
        data["components"] = [c.to_json() for c in self.components]
        return data


# One plugin before it is described: (name, distribution, version, source, status, detail).
_Entry = tuple[str, str, str, str, str, str]


def describe_plugins(
    enabled: Sequence[str] = (), *, objects: Mapping[str, Any] | None = None, hook: str | None = None
) -> list[PluginDescription]:
    """Built-ins, then `objects`, then installed plugins by name, each with its hooks and components.

    Installed plugins are imported to list their hooks, unless autoloading is
    disabled (then only those in `enabled`) or AXCORE_LOAD_PLUGINS leaves them out;
    one that fails to import or register is described as broken, with the reason.

    Args:
        enabled: the experiment's `plugins:` list; these plugins are marked enabled.
        objects: plugin objects by name (as for `create_plugin_manager`).
        hook: describe only the plugins implementing this hook.

    Raises:
        UnknownHookError: `hook` is not a hook (the message suggests the closest).
    """
    wanted = {canonicalize_name(PluginRequest.parse(p).name) for p in enabled}
    manager = create_plugin_manager()
    entries = _register_all(manager, dict(objects or {}), wanted)
    specs = set(manager.hookspec_names())
    if hook is not None and hook not in specs:
        raise UnknownHookError(
            f"No hook named '{hook}'{did_you_mean(hook, specs)}; hooks: {', '.join(sorted(specs))}."
        )
    out = []
    for entry in entries:
        description = _describe(manager, entry, specs, wanted, hook)
        if description is not None:
            out.append(description)
    return out


def _register_all(manager: AxcorePluginManager, objects: dict[str, Any], wanted: set[str]) -> list[_Entry]:
    """The built-ins, `objects` and every installed plugin, each registered (not enabled) where it can be."""
    entries: list[_Entry] = [
        (info.name, info.distribution, info.version, info.source, "ok", "") for info in manager.plugins
    ]

    def register(plugin: Any, name: str, dist: str, version: str, source: str) -> tuple[str, str]:
        try:
            manager.register_plugin(plugin, name, distribution=dist, version=version, source=source, enabled=False)
        except PluginError as e:
            return "broken", one_line(e)
        return "ok", ""

    for name, plugin in objects.items():
        entries.append((name, "<local>", "0", "object", *register(plugin, name, "<local>", "0", "object")))
    for name, eps in sorted(installed_plugins().items()):
        if name in objects:
            continue
        dist, version = distribution_of(eps[0])
        if not allowed_to_load(name):
            status, detail = "excluded", f"{LOAD_PLUGINS_ENV} leaves it out"
        elif autoload_disabled() and canonicalize_name(name) not in wanted:
            status, detail = "not-imported", f"{DISABLE_AUTOLOAD_ENV} is set"
        else:
            try:
                plugin, dist, version = load_plugin(name, eps)
            except PluginError as e:
                status, detail = "broken", one_line(e)
            else:
                status, detail = register(plugin, name, dist, version, "entry-point")
        entries.append((name, dist, version, "entry-point", status, detail))
    return entries


def _describe(
    manager: AxcorePluginManager, entry: _Entry, specs: set[str], wanted: set[str], hook: str | None
) -> PluginDescription | None:
    """One entry's description with its hooks and components; None when `hook` is asked and it lacks it."""
    name, dist, version, source, status, detail = entry
    is_enabled = source == "builtin" or (status != "excluded" and canonicalize_name(name) in wanted)
    if status != "ok" or not manager.is_registered(name):
        return PluginDescription(name, dist, version, source, is_enabled, status, detail) if hook is None else None
    hooks = tuple(manager.hooks_of(name))
    if hook is not None and hook not in hooks:
        return None
    unknown = [h for h in hooks if h not in specs]
    components: tuple[Component, ...] = ()
    if unknown:
        status, detail = "broken", f"implements {', '.join(unknown)}, which no hookspec declares"
    else:
        try:
            components = tuple(manager.components_of(name))
        except PluginError as e:
            status, detail = "broken", one_line(e)
    api = getattr(manager.info(name).plugin, API_REQUIREMENT_ATTRIBUTE, None)
    return PluginDescription(
        name, dist, version, source, is_enabled, status, detail, None if api is None else str(api), hooks, components
    )


def plugins_json(
    descriptions: Sequence[PluginDescription], *, experiment: str | None = None, hook: str | None = None
) -> dict[str, Any]:
    """The `axcore plugins --json` document.

    Keys: `plugin_api_version` (this axcore's plugin API), `experiment` and `hook` (as
    asked, or null), `load_plugins` (the names AXCORE_LOAD_PLUGINS allows, sorted, or
    null when unset), `autoload_disabled` (AXCORE_DISABLE_PLUGIN_AUTOLOAD is set), and
    `plugins`: one object per plugin with the keys `PLUGIN_JSON_KEYS` (see
    `PluginDescription`; `components` holds `family`, `kind`, `name`, `override`).
    """
    allowed = load_allow_list()
    return {
        "plugin_api_version": hookspecs.PLUGIN_API_VERSION,
        "experiment": experiment,
        "hook": hook,
        "load_plugins": None if allowed is None else sorted(allowed),
        "autoload_disabled": autoload_disabled(),
        "plugins": [d.to_json() for d in descriptions],
    }


def run(args) -> int:
    """`axcore plugins`: the table (or `--json`) of installed plugins, then the commands plugins add."""
    import json

    enabled = []
    if args.experiment:
        from axcore.experiment.loading import read_experiment_file

        enabled = read_experiment_file(args.experiment, objects=args.objects)[0].get("plugins") or []
    everything = describe_plugins(enabled, objects=args.objects, hook=args.hook)
    shown = [d for d in everything if args.all or args.hook or d.source != "builtin"]
    if args.json:
        print(json.dumps(plugins_json(shown, experiment=args.experiment, hook=args.hook), indent=2))
        return 0
    rows = [
        (d.name, d.distribution, d.version, "built-in" if d.source == "builtin" else "yes" if d.enabled else "no",
         ", ".join(d.hooks) if d.status == "ok" else f"({d.status}: {d.detail})")
        for d in shown
    ]
    header = ("name", "distribution", "version", "enabled", "hooks")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row, description in zip([header, *rows], [None, *shown]):
        print("  ".join([*(str(c).ljust(w) for c, w in zip(row[:4], widths)), row[4]]))
        kinds: dict[str, list[str]] = {}
        for component in description.components if description else ():
            kinds.setdefault(component.kind, []).append(component.name)
        if kinds:
            print("    registers: " + "; ".join(f"{kind} {', '.join(names)}" for kind, names in kinds.items()))
    if not shown:
        print(f"No plugin implements {args.hook}." if args.hook else "No plugins installed; --all lists the built-ins.")
    if args.hook:
        return 0
    commands = sorted(
        (c.name, d.name, c.value.help) for d in everything for c in d.components if c.family == "commands"
    )
    print("\nCommands added by plugins:" if commands else "\nNo plugin adds commands.")
    for name, plugin, help_ in commands:
        print(f"  axcore {name}  (plugin {plugin}) {help_}".rstrip())
    return 0
