"""Experiments: an experiment file (or a built-in name) turned into a resolved, validated config tree.

It owns the experiment schema (`schema`: `ExperimentConfig` and its mesh parts), finding
and reading experiment files (`files`), loading as an explicit list of steps
(`loading.load_experiment`: flags, joining the job, the backend, the plugin manager,
the transforms), the saved-config marker (`saved`), the mesh layout from the matching
mesh rule (`mesh`) with its config modifiers (`config_modifiers`), and validation
(`validation`). It may import the plugin kernel (`plugin/`), the trainer's config and
every component package below them; never `inference/`, `testing/`, `tools/` or `cli/`.
It owns the list of built-in plugins too (`builtins`: `create_plugin_manager`, which is
`axcore.create_plugin_manager`). `axcore.experiment.load_experiment` and the other names
of `loading` and `builtins` are re-exported lazily, so importing one module of this
package stays cheap.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports, module_exports

_WHERE = module_exports(globals(), ["loading", "builtins"])
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
