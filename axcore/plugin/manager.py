"""The plugin manager: pluggy's, with axcore's order, provenance, registries, settings and transforms.

`AxcorePluginManager` wraps one `pluggy.PluginManager` (there is no global one; build it
with `axcore.plugin.loading.create_plugin_manager`). Plugins are registered one by one, each
with the distribution it came from; hooks are called one plugin at a time, in
registration order (built-ins, then `plugins:` order, then an autoloaded hardware
plugin), so every registration names its plugin and every transform sees the previous
one's output. `tryfirst`, `trylast` and wrappers are refused at registration.

A plugin may require a version of the plugin API (`hookspecs.PLUGIN_API_VERSION`)
with a module or class attribute `AXCORE_PLUGIN_API = ">=1.0"` (a version specifier),
checked when it is registered.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
from collections.abc import Mapping
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from axcore.config import ConfigBase, from_dict, raise_collected
from axcore.errors import ConfigError, NoMatchError, PluginError, PluginLoadError, PluginVersionError
from axcore.kernels.registry import KernelRegistry, Op
from axcore.plugin import hookspecs
from axcore.plugin.flags import choose_flags_environment, merge_runtime_environment, merge_xla_flags
from axcore.plugin.write_log import WriteLog
from axcore.registry import Family, FamilyHook, Provenance, Registries, Registry, family_hook

# Plugin attribute holding the plugin API versions it works with, e.g. ">=1.0,<2".
API_REQUIREMENT_ATTRIBUTE = "AXCORE_PLUGIN_API"
# The distribution of the built-in plugins (axcore itself).
BUILTIN_DISTRIBUTION = "axcore"
# Hook implementation options that would reorder plugins; axcore refuses them (it orders by `plugins:`).
_REFUSED_OPTIONS = ("tryfirst", "trylast", "wrapper", "hookwrapper")


@dataclasses.dataclass
class PluginInfo:
    """A registered plugin."""

    # The name it is registered under: its `plugins:` / entry-point name, or a built-in's module name.
    name: str
    # The plugin object pluggy calls (a module or an instance).
    plugin: Any
    # The distribution it came from ("axcore" for built-ins, "<local>" for objects given by code).
    distribution: str
    # That distribution's version.
    version: str
    # "builtin", "entry-point", "platform" (autoloaded for the detected platform) or "object".
    source: str
    # Whether its registration hooks fill the manager's registries.
    enabled: bool
    # Whether its settings and config transform apply: built-ins and plugins listed in `plugins:`.
    listed: bool = True


@dataclasses.dataclass(frozen=True)
class Component:
    """One thing a plugin registers."""

    # Registry family, e.g. "layers".
    family: str
    # Kind of entry, e.g. "layer".
    kind: str
    # Registered name; a kernel's is "OP/KERNEL", e.g. "attention/xla".
    name: str
    # Whether it was registered with override=True.
    override: bool = False
    # The registered object (not part of the JSON listing).
    value: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "kind": self.kind, "name": self.name, "override": self.override}


def _check_api_requirement(plugin: Any, name: str, distribution: str) -> None:
    """Raises if `plugin`'s AXCORE_PLUGIN_API specifier excludes this axcore's plugin API version."""
    required = getattr(plugin, API_REQUIREMENT_ATTRIBUTE, None)
    if required is None:
        return
    try:
        spec = SpecifierSet(required) if isinstance(required, str) else None
    except InvalidSpecifier:
        spec = None
    if spec is None:
        raise PluginLoadError(
            f"Plugin '{name}' (distribution {distribution}) sets {API_REQUIREMENT_ATTRIBUTE} = {required!r}, which is "
            f"not a version specifier; write e.g. {API_REQUIREMENT_ATTRIBUTE} = \">={hookspecs.PLUGIN_API_VERSION}\"."
        )
    if not spec.contains(hookspecs.PLUGIN_API_VERSION, prereleases=True):
        raise PluginVersionError(
            f"Plugin '{name}' (distribution {distribution}) requires axcore plugin API {spec}, but axcore "
            f"{_core_version()} provides plugin API {hookspecs.PLUGIN_API_VERSION}; upgrade axcore, install a "
            f"release of {distribution} made for plugin API {hookspecs.PLUGIN_API_VERSION}, or remove it from "
            f"`plugins:`."
        )


def _record_registrations(registry: Registry, family: Family, found: list[Component]) -> None:
    """Makes `registry` append a Component to `found` for each registration it accepts."""
    accept = registry.register

    def register(name: Any, value: Any, provenance: Provenance, override: bool = False) -> None:
        accept(name, value, provenance, override)
        if isinstance(registry, KernelRegistry):  # `name` is the op; the kernel names itself.
            name = f"{name.name if isinstance(name, Op) else name}/{getattr(value, 'name', value)}"
        found.append(Component(family.name, family.kind, str(name), override, value))

    registry.register = register  # type: ignore[method-assign]


class UnknownHookError(PluginError):
    """A hook name (e.g. `axcore plugins --hook NAME`) that no hookspec declares."""


class AxcorePluginManager:
    """Wraps a pluggy PluginManager with axcore's ordering, provenance and registries."""

    def __init__(self):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._infos: dict[str, PluginInfo] = {}
        self._registries: Registries | None = None

    # -- Registering plugins ---------------------------------------------------------

    def register_plugin(
        self,
        plugin: Any,
        name: str,
        *,
        distribution: str = "<local>",
        version: str = "0",
        source: str = "object",
        enabled: bool = True,
        listed: bool = True,
    ) -> PluginInfo:
        """Registers a plugin object (module or instance) under `name`.

        Raises:
            PluginLoadError: an implementation has an unknown argument or asks for an
                ordering axcore does not honour (tryfirst, trylast, wrapper, hookwrapper).
        """
        if name in self._infos:
            raise PluginError(f"Plugin '{name}' is already registered ({self._infos[name].distribution}).")
        if inspect.isclass(plugin):
            plugin = plugin()
        _check_api_requirement(plugin, name, distribution)
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginLoadError(
                f"Plugin '{name}' (distribution {distribution}) has an invalid hook "
                f"implementation: {' '.join(str(e).split())} Fix the plugin or remove it "
                f"from `plugins:`."
            ) from None
        info = PluginInfo(name, plugin, distribution, version, source, enabled, listed)
        try:
            self._refuse_ordering_options(info)
            self._infos[name] = info
            self._call(info, "axcore_add_hookspecs", add_hookspecs=self._add_hookspecs)
        except BaseException:
            self._infos.pop(name, None)
            self.pm.unregister(plugin)
            raise
        self._registries = None
        return info

    def _refuse_ordering_options(self, info: PluginInfo) -> None:
        for caller in self.pm.get_hookcallers(info.plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is not info.plugin:
                    continue
                asked = [opt for opt in _REFUSED_OPTIONS if getattr(impl, opt, False)]
                if asked:
                    raise PluginLoadError(
                        f"Plugin '{info.name}' (distribution {info.distribution}) marks its {caller.name} "
                        f"implementation {', '.join(f'{o}=True' for o in asked)}; axcore calls plugins one at a "
                        f"time in `plugins:` order and does not honour {', '.join(_REFUSED_OPTIONS)}. Remove "
                        f"the option from @hookimpl."
                    )

    def _add_hookspecs(self, module_or_class: Any) -> None:
        """`add_hookspecs` callback of `axcore_add_hookspecs`: only `axcore_*` hooks may be added."""
        names = [n for n in dir(module_or_class) if self.pm.parse_hookspec_opts(module_or_class, n) is not None]
        bad = [n for n in names if not n.startswith("axcore_")]
        if bad:
            raise PluginLoadError(f"Hookspecs {bad} must be named axcore_*; rename them.")
        self.pm.add_hookspecs(module_or_class)

    def check_pending(self) -> None:
        """Raises if a plugin implements a hook that does not exist (e.g. a typo)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise PluginLoadError(
                f"{' '.join(str(e).split())}. Hook names must match axcore/plugin/hookspecs.py; fix the plugin or "
                f"remove it from `plugins:`."
            ) from None

    def is_registered(self, name: str) -> bool:
        """Whether a plugin is registered under `name`."""
        return name in self._infos

    def info(self, name: str) -> PluginInfo:
        """What was recorded when plugin `name` was registered (KeyError if it was not)."""
        return self._infos[name]

    @property
    def plugins(self) -> list[PluginInfo]:
        """All registered plugins, built-ins first, then in request order."""
        return list(self._infos.values())

    @property
    def enabled(self) -> list[PluginInfo]:
        return [info for info in self._infos.values() if info.enabled]

    def hooks_of(self, name: str) -> list[str]:
        """Names of the hooks plugin `name` implements."""
        plugin = self._infos[name].plugin
        return sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])

    def hookspec_names(self) -> list[str]:
        """Every hook with a spec: axcore's and those added by registered plugins."""
        return sorted(n for n, caller in vars(self.pm.hook).items() if getattr(caller, "spec", None) is not None)

    def components_of(self, name: str) -> list[Component]:
        """What plugin `name`'s registration hooks register, sorted by family and name.

        Registered into registries of its own (no other plugin's entries), so plugins
        that could not be enabled together are described without conflicting.

        Raises:
            PluginError: its registrations are invalid (a bad value, one name twice).
        """
        info = self._infos[name]
        implemented = set(self.hooks_of(name))
        hooks = [(hook, declared) for hook, declared in self._family_hooks() if hook in implemented]
        regs = Registries(declared.family for _, declared in hooks)
        found: list[Component] = []
        for family in regs.families():
            _record_registrations(regs.family(family.name), family, found)
        prov = Provenance(info.name, info.distribution)
        for hook_name, declared in hooks:
            registry = regs.family(declared.family.name)
            register = declared.callback(registry, prov) if declared.callback else registry.register_callback(prov)
            self._call(info, hook_name, register=register)
        return sorted(found, key=lambda c: (c.family, c.name))

    # -- Calling hooks plugin by plugin ------------------------------------------------

    def _call(self, info: PluginInfo, hook_name: str, **kwargs) -> list[Any]:
        """Calls plugin `info`'s implementations of `hook_name` through pluggy.

        pluggy passes each implementation the arguments it declares; the other plugins
        are left out of this call, so axcore decides the order across plugins.
        """
        others = [p for p in self.pm.get_plugins() if p is not info.plugin]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)

    def xla_flags(self, instance_type: str) -> dict[str, str]:
        """Every enabled plugin's `axcore_xla_flags(instance_type)`, merged (values as strings).

        Raises:
            PluginConflictError: two plugins give one flag different values (naming both).
            PluginLoadError: a plugin returned something other than a mapping of flags.
        """
        return merge_xla_flags(
            (info.name, info.distribution, answer)
            for info in self.enabled
            for answer in self._call(info, "axcore_xla_flags", instance_type=instance_type)
        )

    def runtime_environment(self, instance_type: str) -> dict[str, str]:
        """Every enabled plugin's `axcore_runtime_environment(instance_type)`, merged.

        Raises:
            PluginConflictError: two plugins give one variable different values (naming both).
            PluginLoadError: a plugin returned something other than a mapping.
        """
        return merge_runtime_environment(
            (info.name, info.distribution, answer)
            for info in self.enabled
            for answer in self._call(info, "axcore_runtime_environment", instance_type=instance_type)
        )

    def flags_environment(self, instance_type: str) -> str:
        """The variable carrying compiler flags for `instance_type` (plugins' answer, else XLA_FLAGS).

        Raises:
            PluginConflictError: two plugins name different variables (naming both).
        """
        answers = (
            (info.name, name)
            for info in self.enabled
            for name in self._call(info, "axcore_flags_environment", instance_type=instance_type)
        )
        return choose_flags_environment(answers, instance_type)

    def _family_hooks(self) -> list[tuple[str, FamilyHook]]:
        """(hook name, family declaration) of every registration hookspec, sorted by hook name."""
        found = []
        for name in sorted(vars(self.pm.hook)):
            caller = getattr(self.pm.hook, name)
            spec = getattr(caller, "spec", None)
            declared = family_hook(spec.function) if spec is not None else None
            if declared is not None:
                found.append((name, declared))
        return found

    @property
    def registries(self) -> Registries:
        """Registries filled by the registration hooks of built-in and enabled plugins."""
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries

    def _build_registries(self) -> Registries:
        hooks = self._family_hooks()
        regs = Registries(declared.family for _, declared in hooks)
        for info in self.enabled:
            prov = Provenance(info.name, info.distribution)
            for hook_name, declared in hooks:
                registry = regs.family(declared.family.name)
                register = declared.callback(registry, prov) if declared.callback else registry.register_callback(prov)
                self._call(info, hook_name, register=register)
        regs.finalize()
        return regs

    @property
    def listed(self) -> list[PluginInfo]:
        """Plugins whose settings and transforms apply: built-ins and those in `plugins:`."""
        return [info for info in self._infos.values() if info.enabled and info.listed]

    def settings(
        self, raw: Mapping[str, Any] | None = None, *, errors: list[ConfigError] | None = None
    ) -> dict[str, ConfigBase | None]:
        """Each enabled plugin's settings, with `raw[plugin_name]` merged in.

        `errors`: a list to collect every bad setting in (of every plugin, as
        `from_dict(..., errors=...)` does) instead of raising the first one.

        Raises:
            ConfigError: settings given for a plugin that takes none, or invalid ones
                (only without `errors`).
        """
        collect = errors is not None
        errors = errors if collect else []
        raw = dict(raw or {})
        out: dict[str, ConfigBase | None] = {}
        for info in self.listed:
            declared = [r for r in self._call(info, "axcore_settings_config") if r is not None]
            data = raw.pop(info.name, None)
            if not declared:
                if data:
                    errors.append(ConfigError(f"Plugin '{info.name}' takes no settings, but '{info.name}:' has {data!r}."))
                out[info.name] = None
                continue
            base = declared[0]
            if not isinstance(base, ConfigBase):
                raise PluginLoadError(
                    f"Plugin '{info.name}': axcore_settings_config returned {type(base).__name__}, not a config; "
                    f"return an instance of a ConfigBase subclass (e.g. MySettings()), not a dict."
                )
            out[info.name] = from_dict(data or {}, self.registries, base, path=info.name, errors=errors)
        if raw:
            names = ", ".join(sorted(raw))
            errors.append(ConfigError(f"Settings given for plugin(s) not enabled: {names}; add them to `plugins:`."))
        if not collect:
            raise_collected(errors)
        return out

    def transform_config(self, config: ConfigBase, settings: Mapping[str, ConfigBase | None] | None = None) -> ConfigBase:
        """Runs enabled plugins' config transforms in order; returns the new tree.

        Transforms compose in `plugins:` order: each sees the previous one's output.
        A transform may build on what an earlier plugin installed (e.g. wrap it, or
        edit values nested inside it), but changing a value that an earlier plugin
        wrote (e.g. a slot's `type`) raises PluginConflictError naming both plugins,
        so no plugin silently overwrites another.
        """
        settings = dict(settings) if settings is not None else self.settings()
        writes = WriteLog(self.registries)
        for info in self.listed:
            kwargs = {"config": config, "settings": settings.get(info.name), "registries": self.registries}
            try:
                results = self._call(info, "axcore_transform_config", **kwargs)
            except NoMatchError as e:
                raise NoMatchError(f"Plugin '{info.name}' found nothing to transform: {e}") from None
            if not results and "axcore_transform_config" in self.hooks_of(info.name):
                results = [None]  # pluggy drops None results; a transform must return the config.
            for new in results:
                if not isinstance(new, ConfigBase):
                    raise PluginLoadError(
                        f"The config transform of plugin '{info.name}' ({info.distribution}) "
                        f"returned {type(new).__name__}; it must return the new config."
                    )
                writes.record(info.name, config, new)
                config = new
        return config


@functools.cache
def _core_version() -> str:
    """The installed axcore distribution's version ("0+unknown" when run from a bare source tree)."""
    try:
        return importlib.metadata.version(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
