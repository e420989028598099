"""The plugin kernel: the hook specifications, discovery, the plugin manager and what it records.

It owns the plugin API (`hookspecs`, every `axcore_*` hook, with the typed `register`
callbacks of `register_callbacks`), finding installed plugins from package metadata
without importing them (`entry_points`, `instance_probe`), parsing `plugins:` entries
(`requests`), the manager itself (`manager`: order, provenance, registries, settings,
transforms; `write_log`: who wrote which config value; `flags`: merging the plugins'
XLA flags), the commands plugins add (`commands`), and building a manager from the
built-ins and the requested plugins (`loading.create_plugin_manager`). It may import
every component package below it (`kernels/`, `layers/`, `data/`, `checkpoint/`,
`observe/`, `learning/`, `platform/`, `module`, `params`, `registry`, `config/`), never
`experiment/`, `trainer/`, `inference/` or `cli/`. The names below are re-exported
lazily, so `import axcore.plugin` stays cheap.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports, module_exports

_WHERE = module_exports(globals(), ["loading"])
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
