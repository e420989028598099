"""Hookspecs of a listed plugin's config: its settings section and its config transform.

The calling convention, the phases and the evolution policy: `axcore.plugin.hookspecs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axcore.markers import hookspec

if TYPE_CHECKING:
    from axcore.config import ConfigBase
    from axcore.registry import Registries

# -- Phase 2: settings -----------------------------------------------------------------


@hookspec
def axcore_settings_config() -> ConfigBase | None:
    """Declare the config of this plugin's own section in the experiment file.

    Returns a fresh `ConfigBase` with defaults, or None if the plugin takes no
    settings. The experiment's top-level key named after the plugin (e.g. `my_feature:`)
    is merged into it with the same validation as any config (unknown keys get a
    "did you mean"). Called once per enabled plugin, in `plugins:` order, before
    config transforms; the result is passed to that plugin's transform as `settings`.
    """


# -- Phase 3: config transforms --------------------------------------------------------


@hookspec
def axcore_transform_config(config: ConfigBase, settings: ConfigBase | None, registries: Registries) -> ConfigBase:
    """Install a feature by editing the experiment's config tree.

    Args:
        config: the current config tree (already transformed by earlier plugins).
        settings: this plugin's settings (see `axcore_settings_config`), or None.
        registries: the manager's registries, to look up components by name.

    Returns the new config tree; it must not be None. Use `axcore.config.replace`,
    which returns a new tree and raises when nothing matched, so a feature that
    finds nothing to install is an error rather than a silent no-op. Called only for
    enabled plugins, once each, in `plugins:` order; each transform sees the output
    of the previous one, so two plugins touching one slot compose in list order.
    """
