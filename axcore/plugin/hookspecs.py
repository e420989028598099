"""Every extension point of axcore, grouped by the phase in which it is called.

Plugins implement any subset of these with `@axcore.hookimpl`; an implementation may
declare fewer arguments than the spec (pluggy passes only those it names), so specs
only ever gain arguments and old plugins keep working.

Calling convention: pluggy calls the hooks, one plugin at a time (through
`PluginManager.subset_hook_caller`): built-in plugins first, then the plugins of the
experiment's `plugins:` list in list order, then an autoloaded hardware plugin, so
every registration knows which plugin and distribution made it and every transform
sees the result of the previous one. The order is axcore's, so implementations may
not ask for another: `tryfirst`, `trylast`, `wrapper` and `hookwrapper` are refused
when the plugin is registered (PluginLoadError). Nothing here stops at the first
non-None result.

The specs live in one module per phase of `axcore.plugin.specs` (`PHASES`, in the
order docs/hooks.md lists them); this module gathers them (`HOOKSPECS`), so each hook
is also `axcore.plugin.hookspecs.<hook>` and a manager adds them all from here.

Phases:
0. Hookspecs (`axcore_add_hookspecs`): a plugin adds hooks of its own (e.g. a new
   registry family) when it is registered.
1. Registration (`axcore_register_*`): fill typed registries through a `register`
   callback. Each registration spec declares the registry family it fills with
   `@registers(Family(...))` (name, kind of entry, validator, whether configs may
   name entries); `registries.<family>` is built from these declarations. A name
   registered twice is an error naming both distributions unless exactly one
   registration passes `override=True` (that one wins).
2. Settings (`axcore_settings_config`): declare the config of the plugin's own
   top-level section in the experiment file.
3. Config transform (`axcore_transform_config`): a plugin listed in `plugins:`
   edits the experiment's config tree.

Evolution policy (the plugin API, version `PLUGIN_API_VERSION`, MAJOR.MINOR):
- Hookspecs only gain arguments, never lose or rename one, and an argument keeps
  its meaning. A plugin built against an older spec declares fewer arguments and
  keeps working: pluggy passes each implementation only the arguments it names.
  Adding a hook or an argument bumps MINOR.
- A hook or an argument to be retired is first deprecated: its spec gains
  `warn_on_impl=DeprecationWarning(...)` (or `warn_on_impl_args={"arg": ...}`), so
  pluggy warns, naming the plugin's function, when a plugin implementing it is
  registered. It is removed no earlier than the next MAJOR.
- A plugin may require an API version with a module (or class) attribute holding
  a version specifier, e.g. `AXCORE_PLUGIN_API = ">=1.0,<2"`; registering it
  against an axcore whose `PLUGIN_API_VERSION` does not match fails with a one-line
  PluginVersionError naming the plugin. `tests/plugin/test_hookspec_policy.py` checks that
  every spec of API 1.0 still exists with its arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

from axcore.markers import PROJECT_NAME, hookimpl, hookspec
from axcore.plugin.register_callbacks import RegisterCommand, RegisterComponent, RegisterKernel, RegisterNamed
from axcore.plugin.specs import config, data, extension, model, platform, training

# Version of the plugin API these specs define (see "Evolution policy" above); a plugin
# requires one with `AXCORE_PLUGIN_API = ">=1.0"`.
PLUGIN_API_VERSION = "1.4"

# The phase modules, in the order the hook reference (docs/hooks.md) lists them.
PHASES: tuple[ModuleType, ...] = (extension, model, data, training, platform, config)


def specs_of(module: ModuleType) -> dict[str, Callable]:
    """Hook name -> spec function of every `axcore_*` function defined in `module`, in source order."""
    return {
        name: fn for name, fn in vars(module).items()
        if name.startswith("axcore_") and inspect.isfunction(fn) and fn.__module__ == module.__name__
    }


# Hook name -> its spec function, every phase in `PHASES` order.
HOOKSPECS: dict[str, Callable] = {name: fn for module in PHASES for name, fn in specs_of(module).items()}
# Each spec is an attribute here too: `pm.add_hookspecs(hookspecs)` and `hookspecs.<hook>` see them all.
globals().update(HOOKSPECS)

# The Register* Protocols (axcore/plugin/register_callbacks.py) type each registration hook's `register` argument.
__all__ = ["HOOKSPECS", "PHASES", "PLUGIN_API_VERSION", "PROJECT_NAME", "hookimpl", "hookspec", "specs_of"]
__all__ += ["RegisterCommand", "RegisterComponent", "RegisterKernel", "RegisterNamed"]
