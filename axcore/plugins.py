"""The plugin manager: built-ins, entry-point plugins by name, registries, transforms.

`create_plugin_manager(["my_feature>=0.2", "other"])` builds a manager (there is no global
one): built-in plugins first, through the same hooks as third-party ones; then each
requested plugin, loaded from the `axcore` entry-point group *by name* (no other
entry point is imported); then, if a platform is given, the hardware plugin named
after it. Set AXCORE_DISABLE_PLUGIN_AUTOLOAD=1 to load only plugins named
explicitly (the escape hatch when an installed plugin is broken), and
AXCORE_LOAD_PLUGINS=rope,moe to let only the listed installed plugins load at all
(an empty value: none); plugins given as objects by code are not affected.

A plugin may require a version of the plugin API (`hookspecs.PLUGIN_API_VERSION`)
with a module or class attribute `AXCORE_PLUGIN_API = ">=1.0"` (a version specifier),
checked when it is registered. `axcore.plugin_listing.describe_plugins` is what `axcore plugins` shows.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from axcore import hookspecs
from axcore.config import ConfigBase, from_dict, raise_collected
from axcore.entry_points import (  # Re-exported: discovery reads metadata only (axcore/entry_points.py).
    DISABLE_AUTOLOAD_ENV,
    ENTRY_POINT_GROUP,
    LOAD_PLUGINS_ENV,
    _allowed,
    _dist_of,
    _scanned_entry_points,
    autoload_disabled,
    excluded_entry_points,
    installed_entry_points,
    load_allow_list,
)
from axcore.errors import (
    ConfigError,
    NoMatchError,
    PluginConflictError,
    PluginError,
    PluginLoadError,
    PluginVersionError,
    UnknownPluginError,
    did_you_mean,
)
from axcore.kernels.registry import KernelRegistry, Op
from axcore.registry import Family, FamilyHook, Provenance, Registries, Registry, family_hook
from axcore.write_log import WriteLog
from axcore.xla_flags import check_flag_name, flag_value

logger = logging.getLogger(__name__)

# Plugin attribute holding the plugin API versions it works with, e.g. ">=1.0,<2".
API_REQUIREMENT_ATTRIBUTE = "AXCORE_PLUGIN_API"
BUILTIN_DISTRIBUTION = "axcore"
# Hook implementation options that would reorder plugins; axcore refuses them (it orders by `plugins:`).
_REFUSED_OPTIONS = ("tryfirst", "trylast", "wrapper", "hookwrapper")

# Core modules that are plugins, registered first (like pytest's default_plugins).
BUILTIN_PLUGINS = (
    "axcore.layers.plugin",
    "axcore.kernels.plugin",
    "axcore.mesh",
    "axcore.config_modifiers",
    "axcore.data.plugin",
    "axcore.checkpoint.plugin",
    "axcore.trainer.plugin",
    "axcore.observe.plugin",
    "axcore.experiments.plugin",
)


@dataclasses.dataclass(frozen=True)
class PluginRequest:
    """One `plugins:` entry: a name and an optional version specifier."""

    name: str
    specifier: str = ""

    @classmethod
    def parse(cls, text: Any, where: str = "plugins") -> PluginRequest:
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


@dataclasses.dataclass
class PluginInfo:
    """A registered plugin."""

    name: str
    plugin: Any
    distribution: str
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


class PluginExcludedError(UnknownPluginError):
    """A `plugins:` entry names an installed plugin that AXCORE_LOAD_PLUGINS leaves out."""


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
                f"{' '.join(str(e).split())}. Hook names must match axcore/hookspecs.py; fix the plugin or "
                f"remove it from `plugins:`."
            ) from None

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
        flags: dict[str, str] = {}
        owners: dict[str, str] = {}
        for info in self.enabled:
            for answer in self._call(info, "axcore_xla_flags", instance_type=instance_type):
                if not isinstance(answer, Mapping):
                    raise PluginLoadError(
                        f"Plugin '{info.name}' ({info.distribution}): axcore_xla_flags returned "
                        f"{type(answer).__name__}; return a dict of flag -> value, or None."
                    )
                for name, value in answer.items():
                    where = f"flag {name} of plugin '{info.name}'"
                    value = flag_value(value, where)
                    if name in flags and flags[name] != value:
                        raise PluginConflictError(
                            f"Plugins '{owners[name]}' and '{info.name}' set XLA flag {check_flag_name(name, where)} "
                            f"to {flags[name]!r} and {value!r}; choose one in the experiment's xla_flags."
                        )
                    flags[check_flag_name(name, where)] = value
                    owners.setdefault(name, info.name)
        return flags

    def flags_environment(self, instance_type: str) -> str:
        """The variable carrying compiler flags for `instance_type` (plugins' answer, else XLA_FLAGS).

        Raises:
            PluginConflictError: two plugins name different variables (naming both).
        """
        chosen: tuple[str, str] | None = None
        for info in self.enabled:
            for name in self._call(info, "axcore_flags_environment", instance_type=instance_type):
                if chosen is not None and chosen[1] != name:
                    raise PluginConflictError(
                        f"Plugins '{chosen[0]}' and '{info.name}' want the compiler flags of {instance_type} in "
                        f"{chosen[1]} and {name}; uninstall or unlist one of them."
                    )
                chosen = (info.name, str(name))
        return chosen[1] if chosen else "XLA_FLAGS"

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


# Platforms whose hardware plugin (the entry point of that name) may say, before JAX starts,
# whether this machine has its devices; a platform's plugin is named after it to autoload.
HARDWARE_PLATFORMS = ("gpu", "tpu", "neuron")
# CPU devices JAX creates, from XLA_FLAGS (1 when the flag is absent).
_HOST_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def _jax_platforms() -> str:
    """JAX's `jax_platforms` setting (JAX_PLATFORMS), read without starting a backend."""
    import jax  # Reading a config option starts no backend.

    return jax.config.jax_platforms or ""


def probe_instance_type() -> str | None:
    """This machine's instance type, found without starting JAX's backend, or None.

    JAX_PLATFORMS naming `cpu` first gives `cpu-N` (N from the host-device-count flag);
    otherwise the installed hardware plugins (the entry points named after a platform
    of `HARDWARE_PLATFORMS`, as hardware plugins are named so that they autoload) are
    asked through `axcore_probe_instance_type`, in that order, the first non-None answer
    winning. Other plugins are never imported here (start-up stays cheap).
    Autoloading disabled (AXCORE_DISABLE_PLUGIN_AUTOLOAD) asks no plugin.

    A plugin that fails to import or whose probe raises is skipped with a warning naming
    it (the run may not use it; loading it by name reports the error).
    """
    platforms = [p for p in _jax_platforms().split(",") if p]
    if platforms and platforms[0] == "cpu":
        count = _HOST_DEVICE_COUNT.search(os.environ.get("XLA_FLAGS", ""))
        return f"cpu-{count[1] if count else 1}"
    if autoload_disabled():
        return None
    installed = installed_entry_points()
    for name in HARDWARE_PLATFORMS:
        entry_points = installed.get(name, [])
        if len(entry_points) != 1:
            continue  # None, or ambiguous (reported when the plugin is loaded by name).
        try:
            module = entry_points[0].load()
            probe = getattr(module, "axcore_probe_instance_type", None)
            found = probe() if callable(probe) else None
        except Exception as e:  # An installed plugin the run may not use: warned about by name, then skipped.
            logger.warning(
                "Plugin '%s' failed while probing the instance type (%s: %s); skipped. 'axcore plugins' "
                "shows its state; uninstall it or name the instance with --mesh-selector.",
                name,
                type(e).__name__,
                e,
            )
            continue
        if found:
            logger.debug("Plugin '%s' probed instance type %s.", name, found)
            return str(found)
    return None


def builtin_registries() -> Registries:
    """Registries of a manager with only the built-in plugins."""
    return create_plugin_manager().registries


def _load_entry_point(name: str, eps: list[importlib.metadata.EntryPoint]) -> tuple[Any, str, str]:
    if len(eps) > 1:
        dists = ", ".join(_dist_of(ep)[0] for ep in eps)
        raise PluginError(f"Plugin name '{name}' is provided by several distributions ({dists}); uninstall all but one.")
    ep = eps[0]
    dist, version = _dist_of(ep)
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
) -> AxcorePluginManager:
    """Builds a plugin manager.

    Args:
        plugins: the experiment's `plugins:` list, e.g. `["my_feature>=0.2", "other"]`, enabled
            in this order.
        objects: plugin objects registered directly by code, by name; a requested name
            is looked up here before the entry points.
        platform: the detected platform ("gpu", "tpu", ...); the entry point of that
            name is loaded too unless AXCORE_DISABLE_PLUGIN_AUTOLOAD is set.

    Raises:
        UnknownPluginError: a requested name is neither given nor installed (the
            message lists the installed names).
        PluginVersionError: an installed version does not satisfy the specifier.
        PluginLoadError: a plugin fails to import or has invalid hook implementations.
    """
    manager = AxcorePluginManager()
    for module_name in BUILTIN_PLUGINS:
        module = importlib.import_module(module_name)
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
        if not eps and not _allowed(request.name, load_allow_list()):
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
        dist, version = _dist_of(eps[0])
        if request.specifier and not SpecifierSet(request.specifier).contains(version, prereleases=True):
            raise PluginVersionError(
                f"Plugin '{request.name}' {request.specifier} was asked for, but {dist} {version} "
                f"is installed; install a matching version or relax the specifier."
            )
        plugin, dist, version = _load_entry_point(request.name, eps)
        manager.register_plugin(plugin, request.name, distribution=dist, version=version, source="entry-point")
    if platform and platform in objects and platform not in manager._infos:
        # Given as an object (tests, notebooks): registered as an autoloaded hardware plugin would be.
        manager.register_plugin(objects[platform], platform, source="platform", listed=False)
    if platform and not autoload_disabled() and platform not in manager._infos:
        if entry_points is None:
            entry_points = installed_entry_points()
        if platform in entry_points:
            plugin, dist, version = _load_entry_point(platform, entry_points[platform])
            # Registers kernels and mesh rules; its transforms run only if `plugins:` lists it.
            manager.register_plugin(
                plugin, platform, distribution=dist, version=version, source="platform", listed=False
            )
    manager.check_pending()
    return manager


@functools.cache
def _core_version() -> str:
    try:
        return importlib.metadata.version(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
