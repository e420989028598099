"""The saved-config marker: a resolved experiment loads back as it ran, its transforms never applied twice.

`Experiment.save(run_dir)` (what the trainer calls) writes `config.txt`, the flat
dump (`Experiment.flat()`), and `config.yaml`, the resolved experiment
(`Experiment.to_dict()`) under a first top-level key `resolved_by` that records what
already happened to it:

    resolved_by:
      axcore: 0.1.0                          # the version that resolved it
      plugins: [rope, swiglu]                # plugins whose config transforms ran, in order
      mesh_rule: default (plugin axcore.platform.mesh)  # the mesh rule applied ...
      mesh_modifiers: []                     # ... and the config modifiers it ran
    plugins: [rope, swiglu]
    rope: {theta: 10000.0}
    model: ...

Loading a file with `resolved_by` enables its plugins as usual (their components,
kernels, settings and hooks) but runs neither their config transforms nor the mesh
rule's modifiers, nor resolves `xla_flags` again: the config is taken as it is, so
a transform that is not idempotent (one that doubles a value, say) is never applied
twice, and `axcore config RUN_DIR/config.yaml` prints the run's `config.txt`.
`--set` overrides still apply (e.g. `trainer.max_steps` to train on). Its `plugins:`
must still name the plugins of `resolved_by.plugins`, in that order: a transform
that ran cannot be undone, nor a new one run on a resolved config (change the
original experiment instead). A file without `resolved_by` (an experiment written
by hand, or a run directory of an older axcore) is resolved in full.

This module writes and checks the marker; `axcore.experiment.loading.load_experiment` decides
which steps it skips.

Layer: experiment (imports errors and the plugin manager's request parser).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from axcore import __version__
from axcore.errors import ConfigError
from axcore.plugin.loading import PluginRequest

logger = logging.getLogger(__name__)

# Top-level key of a saved resolved experiment (`Experiment.save`): what already ran (module docstring).
RESOLVED_KEY = "resolved_by"

# The marker's keys, in the order `resolved_marker` writes them.
_MARKER_KEYS = ("axcore", "plugins", "mesh_rule", "mesh_modifiers")


def resolved_marker(plugins: Sequence[str], mesh_rule: str, mesh_modifiers: Sequence[str]) -> dict[str, Any]:
    """The `resolved_by` mapping for an experiment whose `plugins:` entries (names with optional
    version specifiers) ran their transforms and whose `mesh_rule` applied `mesh_modifiers`."""
    return {
        "axcore": __version__,
        "plugins": [PluginRequest.parse(p).name for p in plugins],
        "mesh_rule": mesh_rule,
        "mesh_modifiers": list(mesh_modifiers),
    }


def check_resolved_marker(marker: Any, label: str) -> dict[str, Any] | None:
    """The checked `resolved_by` mapping of a saved resolved experiment, or None (none there).

    Missing keys take their empty defaults; a marker written by another axcore version
    is accepted with a warning.

    Raises:
        ConfigError naming `label` if `marker` is not a mapping of the four keys above.
    """
    if marker is None:
        return None
    expected = "a mapping with keys axcore, plugins, mesh_rule and mesh_modifiers (as Experiment.save writes it)"
    if not isinstance(marker, dict):
        raise ConfigError(f"{label}: '{RESOLVED_KEY}' must be {expected}, got {marker!r}.")
    marker = {"axcore": None, "plugins": [], "mesh_rule": "", "mesh_modifiers": [], **marker}
    unknown = sorted(set(marker) - set(_MARKER_KEYS))
    lists_of_str = all(
        isinstance(marker[k], list) and all(isinstance(v, str) for v in marker[k]) for k in ("plugins", "mesh_modifiers")
    )
    if unknown or not lists_of_str or not isinstance(marker["mesh_rule"], str):
        raise ConfigError(f"{label}: '{RESOLVED_KEY}' must be {expected}, got {marker!r}.")
    if marker["axcore"] != __version__:
        logger.warning("%s was resolved by axcore %s; this is axcore %s.", label, marker["axcore"], __version__)
    return marker


def check_resolved_plugins(resolved: Mapping[str, Any], plugins: list, label: str) -> None:
    """Raises ConfigError unless `plugins` names the plugins whose transforms already ran, in order."""
    names = [PluginRequest.parse(p, f"plugins[{i}]").name for i, p in enumerate(plugins)]
    ran = list(resolved["plugins"])
    if names != ran:
        raise ConfigError(
            f"{label} is a resolved config (its '{RESOLVED_KEY}' lists the plugins whose transforms ran: "
            f"{ran or 'none'}), but 'plugins' is {names}; a resolved config keeps its plugins. To change them, "
            f"load the original experiment, or delete '{RESOLVED_KEY}' to resolve this file again in full."
        )
