"""`axcore loc`: what each installed feature plugin costs to integrate, computed from code and runs.

For every plugin in the `axcore` entry-point group this reports, in the spirit of
the AXLearn paper's LoC-complexity table:

- hook LoC: lines of the bodies of its config-transform hook implementations (the
  integration) and of all its hook implementations; docstrings, comments and blank
  lines do not count;
- core lines only for it: lines of code under `axcore/` that run with the plugin
  and in no run without it. Each built-in experiment, shrunk by `PROBE_OVERRIDES`,
  is run (resolved, its model built, `parameter_specs()` computed, and the loss of
  one tiny batch computed eagerly through `functional` under `jax.disable_jit()`)
  with `plugins: [<name>]`, without plugins, with a do-nothing plugin (so the
  generic plugin machinery is nobody's), and with each other installed plugin;
  `sys.settrace` records the core lines each run executes. A core feature toggled
  for one plugin (a branch in a core layer) shows here; so does a generic core
  mechanism that only this plugin exercises;
- core mechanisms used: the core config fields the plugin's transform writes (the
  flat resolved config with the plugin against without it), as
  `<component>.<field>`: a field set to a new value (`repeated_transformer.remat_policy`),
  a component slot filled, emptied or given another component
  (`multihead_attention.position_embedding`), or a field turned into a per-layer
  list (`stacked_transformer.layer`);
- layers touched per built-in model family: modules of the instantiated model
  (each built-in experiment) that the plugin adds, removes or reconfigures.

A second table has one row per model family, i.e. per converter a plugin registers
(hook `axcore_register_model_converters`, e.g. `mistral` from the hf plugin):

- hook LoC: body lines of the plugin's converter-registering hook (shared by the
  families it registers);
- helper LoC: code lines of the converter's own methods, and of the functions of the
  plugin's package they call (code inherited from another package, e.g. axcore-hf's
  Llama converter, is that package's);
- core lines only it runs: core lines that a run of the family's example model (the
  converter's `example_config()`, a tiny config.json) executes and no other run does
  (the runs of the plugin table and those of every other family);
- core mechanisms used: the core switches its model sets beyond the default experiment's,
  `<component>.<field>`: a field off by default (False, None, 0) turned on (sizes such
  as `num_kv_heads` and dtypes aside),
  or a component slot filled or emptied (`causal_lm.lm_head` for tied embeddings).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import axcore
from axcore.config import ConfigBase, InstantiableConfig
from axcore.experiment.loading import builtin_experiments, load_experiment, read_experiment_file
from axcore.plugin.loading import installed_entry_points, load_plugin

from axcore_devtools.family_loc import FamilyLoc, family_report, format_family_table
from axcore_devtools.loc_probe import (  # CoreLineTracer and PROBE_OVERRIDES: re-exported, the report's instruments.
    PROBE_OVERRIDES,
    CoreLineTracer,
    Probe,
    _Baseline,
    _helpers,
    _hookimpls,
    _lines_cell,
    body_lines,
    probe,
)

TRANSFORM_HOOK = "axcore_transform_config"
# Name of the do-nothing plugin of the baseline runs.
BASELINE_PLUGIN = "loc-baseline"


@dataclasses.dataclass
class PluginLoc:
    name: str
    distribution: str
    # Body lines of the config-transform hook implementation(s).
    integration_lines: int
    # The same plus the plugin's own helper functions those hooks call (transitively).
    integration_with_helpers: int
    # Body lines of every hook implementation.
    hook_lines: int
    # Core lines (`file:line`, relative to axcore/) that run with the plugin and in no run
    # without it; None if no built-in experiment resolves with the plugin.
    core_lines: frozenset[str] | None
    # Core config fields its transform writes, as `<component>.<field>`, sorted (None: as above).
    core_mechanisms: tuple[str, ...] | None
    # Built-in experiment name -> layers touched (or an error note).
    touched: dict[str, int | str]


def core_fields_written(without: Probe, with_plugin: Probe) -> set[str]:
    """Core config fields that differ between the two runs, as `<component>.<field>`.

    A component slot whose `type` changed, appeared or vanished is named once (its
    contents are the new component's business); so is a field that became a
    per-layer list; any other changed value is named by the component holding it.
    """
    before, after = without.values, with_plugin.values
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)} - {"plugins"}
    slots = {p[: -len(".type")] for p in changed if p.endswith(".type")}

    def inside(path: str, outer: set[str]) -> bool:
        return any(path == s or path.startswith(s + ".") for s in outer)

    slots = {s for s in slots if not inside(s, slots - {s})}
    written = slots | {p for p in with_plugin.lists - without.lists if not inside(p, slots)}
    written |= {p for p in changed if not inside(p, slots)}

    def name(path: str) -> str:
        parent, _, field = path.rpartition(".")
        return f"{without.labels.get(parent) or with_plugin.labels.get(parent, '?')}.{field}"

    return {name(p) for p in written}


@dataclasses.dataclass
class CoreUsage:
    """What one plugin needs from the core, over the built-in experiments."""

    # Core lines that ran with the plugin and in no run without it (`file:line`).
    lines: frozenset[str]
    # Core config fields its transform writes (`<component>.<field>`), sorted.
    fields: tuple[str, ...]
    # Experiment -> why it did not resolve with the plugin (absent when it did).
    errors: dict[str, str]


def probe_experiments() -> list[str]:
    """Built-in experiments that enable no plugin themselves (so each plugin can be probed alone).

    Shape presets such as `llama2_7b` list `plugins:` of their own and are left out, and so
    are recipes that keep the default model (no `model:` of their own, such as `sft`, which
    changes the data and the training only): their layers are `default`'s.
    """
    names = []
    for name in builtin_experiments():
        data = read_experiment_file(name)[0]
        if not data.get("plugins") and (name == "default" or "model" in data):
            names.append(name)
    return names


def core_usage(
    plugins: Sequence[str],
    experiments: Sequence[str] | None = None,
    *,
    objects: Mapping[str, Any] | None = None,
    seen_lines: set[str] | None = None,
) -> dict[str, CoreUsage]:
    """For each of `plugins`, run alone: the core lines only it runs and the core fields it writes.

    A core line counts for plugin P when some run with P executes it and no run
    without P does: over every experiment, the runs without plugins, with the
    do-nothing baseline plugin, and with each other plugin of `plugins`.

    Args:
        plugins: plugin names (installed, or keys of `objects`).
        experiments: built-in experiment names; None = `probe_experiments()`.
        objects: plugin objects by name, as for `load_experiment`.
        seen_lines: if given, filled with the core lines of every run (the model-family table's baseline).
    """
    experiments = list(experiments or probe_experiments())
    objects = {BASELINE_PLUGIN: _Baseline(), **(objects or {})}
    runs: dict[tuple[str, str | None], Probe] = {}
    errors: dict[str, dict[str, str]] = {name: {} for name in plugins}
    for experiment in experiments:
        runs[(experiment, None)] = probe(experiment, objects=objects)
        runs[(experiment, BASELINE_PLUGIN)] = probe(experiment, [BASELINE_PLUGIN], objects=objects)
        for name in plugins:
            try:
                runs[(experiment, name)] = probe(experiment, [name], objects=objects)
            except axcore.AxcoreError as e:
                errors[name][experiment] = type(e).__name__
    if seen_lines is not None:
        seen_lines.update(*(p.lines for p in runs.values()))
    out = {}
    for name in plugins:
        mine = [p.lines for (_, n), p in runs.items() if n == name]
        others = frozenset().union(*(p.lines for (_, n), p in runs.items() if n != name))
        fields = set()
        for (experiment, n), p in runs.items():
            if n == name:
                fields |= core_fields_written(runs[(experiment, None)], p)
        out[name] = CoreUsage(frozenset().union(*mine) - others, tuple(sorted(fields)), errors[name])
    return out


# -- Layers touched ----------------------------------------------------------------------------


def _module_signature(module: Any) -> tuple:
    fields = []
    for key, value in module.config.items():
        if isinstance(value, InstantiableConfig):
            value = ("component", value.target)
        elif isinstance(value, ConfigBase) or isinstance(value, list):
            continue  # Nested plain configs and per-layer lists show up in the children.
        fields.append((key, repr(value)))
    return type(module), tuple(fields)


def _modules(model: Any, prefix: str = "") -> dict[str, Any]:
    path = f"{prefix}.{model.name}" if prefix else model.name
    out = {path: model}
    for child in model.children.values():
        out.update(_modules(child, path))
    return out


def layers_touched(experiment_name: str, plugin: str) -> int:
    """Modules of the built-in experiment's model that `plugin` adds, removes or reconfigures."""
    models = []
    for overrides in ([], [f"plugins=[{plugin}]"]):
        exp = load_experiment(experiment_name, ["mesh.instance_type=cpu-1", *overrides])
        models.append(_modules(exp.config.model.instantiate(name="model", registries=exp.registries)))
    before, after = models
    touched = set(before) ^ set(after)
    touched |= {p for p in set(before) & set(after) if _module_signature(before[p]) != _module_signature(after[p])}
    return len(touched)


# -- The report ----------------------------------------------------------------------------------


class LocReport(list):
    """The plugin rows (a list of PluginLoc) and, in `model_families`, the model-family rows."""

    def __init__(self, rows: Sequence[PluginLoc] = (), model_families: Sequence[FamilyLoc] = ()):
        super().__init__(rows)
        self.model_families = list(model_families)


def loc_report(families: list[str] | None = None) -> LocReport:
    """One row per installed plugin (feature plugins and any others in the group), and one per
    model family a plugin registers a converter for (`axcore_devtools.family_loc`)."""
    families = families or probe_experiments()
    loaded = {name: load_plugin(name, eps) for name, eps in sorted(installed_entry_points().items())}
    seen: set[str] = set()
    usage = core_usage(list(loaded), families, seen_lines=seen)
    rows = []
    for name, (plugin, dist, _) in loaded.items():
        impls = _hookimpls(plugin)
        package = (getattr(plugin, "__package__", None) or getattr(plugin, "__name__", "") or "").split(".")[0]
        transforms = [fn for n, fn in impls.items() if n == TRANSFORM_HOOK]
        helpers = set().union(*(_helpers(fn, package) for fn in transforms)) if transforms else set()
        touched: dict[str, int | str] = {}
        for family in families:
            try:
                touched[family] = layers_touched(family, name)
            except axcore.AxcoreError as e:
                touched[family] = f"n/a ({type(e).__name__})"
        rows.append(
            PluginLoc(
                name=name,
                distribution=dist,
                integration_lines=sum(body_lines(fn) for fn in transforms),
                integration_with_helpers=sum(body_lines(fn) for fn in [*transforms, *helpers]),
                hook_lines=sum(body_lines(fn) for fn in impls.values()),
                core_lines=None if len(usage[name].errors) == len(families) else usage[name].lines,
                core_mechanisms=None if len(usage[name].errors) == len(families) else usage[name].fields,
                touched=touched,
            )
        )
    return LocReport(rows, family_report(seen))


def format_table(rows: list[PluginLoc]) -> str:
    """A Markdown table of the report (then the model-family table, when `rows` is a LocReport with families)."""
    families = list(rows[0].touched) if rows else []
    header = ["plugin", "distribution", "transform hook LoC", "+ its helpers", "all hooks LoC"]
    header += ["core lines only for it", "core mechanisms used"]
    header += [f"layers touched ({f})" for f in families]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.name, r.distribution, str(r.integration_lines), str(r.integration_with_helpers)]
        cells += [str(r.hook_lines), _lines_cell(r.core_lines)]
        mechanisms = "n/a" if r.core_mechanisms is None else ", ".join(f"`{m}`" for m in r.core_mechanisms)
        cells += [mechanisms or "none"]
        cells += [str(r.touched[f]) for f in families]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    model_families = getattr(rows, "model_families", None)
    return table + "\n" + format_family_table(model_families) if model_families else table


__all__ = [
    "PROBE_OVERRIDES",
    "CoreLineTracer",
    "FamilyLoc",
    "LocReport",
    "PluginLoc",
    "Probe",
    "body_lines",
    "core_fields_written",
    "core_usage",
    "format_table",
    "loc_report",
    "probe",
]


if __name__ == "__main__":  # python -m axcore_devtools.loc_report, the same table as `axcore loc`.
    sys.stdout.write(format_table(loc_report()))
