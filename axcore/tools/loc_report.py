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
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
import os
import pathlib
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

import axcore
from axcore import hookimpl
from axcore.config import ConfigBase, InstantiableConfig, flatten, replace, walk
from axcore.experiment.loading import builtin_experiments, load_experiment, read_experiment_file
from axcore.module import functional
from axcore.plugin.loading import _load_entry_point, installed_entry_points

TRANSFORM_HOOK = "axcore_transform_config"
CORE_ROOT = pathlib.Path(axcore.__file__).parent
# Shrink every built-in experiment for the traced runs (moe needs two layers).
PROBE_OVERRIDES = (
    "mesh.instance_type=cpu-1",
    "model.num_layers=2",
    "model.dim=32",
    "model.decoder.layer.self_attention.num_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=64",
)
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


def body_lines(fn: Any) -> int:
    """Non-blank, non-comment lines of a function's body, docstring excluded."""
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # Docstring.
    if not body:
        return 0
    lines = source.splitlines()[body[0].lineno - 1 : node.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def _helpers(fn: Any, package: str, seen: set | None = None) -> set:
    """Functions of `package` that `fn` calls or references, transitively."""
    seen = set() if seen is None else seen
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            target = getattr(fn, "__globals__", {}).get(node.id)
            owner = getattr(target, "__module__", "") or ""
            if inspect.isfunction(target) and owner.split(".")[0] == package and target not in seen:
                seen.add(target)
                _helpers(target, package, seen)
    return seen


def _hookimpls(plugin: Any) -> dict[str, Any]:
    out = {}
    for name in dir(plugin):
        if name.startswith("axcore_"):
            fn = getattr(plugin, name)
            if getattr(fn, "axcore_impl", None) is not None:  # pluggy's hookimpl marker.
                out[name] = fn
    return out


# -- Core lines: which lines under axcore/ a run executes ------------------------------------


class CoreLineTracer:
    """Context manager recording the `file:line`s of function code under `root` that run.

    Uses `sys.settrace` (the current thread only; a tracer already installed, e.g. a
    debugger's, is suspended meanwhile). Module and class bodies are skipped: they run
    once, at import, whichever run happens to import them first.
    """

    def __init__(self, root: pathlib.Path = CORE_ROOT, exclude: Sequence[str] = (__file__,)):
        self.root = str(root) + os.sep
        self.exclude = {os.path.abspath(f) for f in exclude}
        self.lines: set[tuple[str, int]] = set()
        self._wanted: dict[Any, bool] = {}
        self._previous = None

    def _call(self, frame, event, arg):
        code = frame.f_code
        wanted = self._wanted.get(code)
        if wanted is None:
            wanted = self._wanted[code] = (
                code.co_filename.startswith(self.root)
                and code.co_filename not in self.exclude
                and bool(code.co_flags & inspect.CO_OPTIMIZED)  # A function, not a module or class body.
            )
        return self._line if wanted else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines.add((frame.f_code.co_filename, frame.f_lineno))
        return self._line

    def __enter__(self) -> CoreLineTracer:
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._previous)

    def relative(self) -> frozenset[str]:
        """The recorded lines as `path/relative/to/root.py:line`."""
        return frozenset(f"{pathlib.Path(f).relative_to(self.root).as_posix()}:{n}" for f, n in self.lines)


def _rebuilt(value: Any) -> Any:
    """`value` with every config in it rebuilt field by field (each field validated again)."""
    if isinstance(value, ConfigBase):
        return value.clone().set(**{k: _rebuilt(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuilt(v) for v in value)
    return value


class _Baseline:
    """The do-nothing plugin of the baseline runs: settings, and a transform that
    replaces the model config with an equal one rebuilt field by field, so settings,
    the transform loop, `replace` and field validation run without any plugin's feature."""

    class Settings(ConfigBase):
        """Settings of the baseline plugin."""

        # Unused.
        scale: float | None = None

    @hookimpl
    def axcore_settings_config(self):
        return self.Settings()

    @hookimpl
    def axcore_transform_config(self, config):
        return replace(config, lambda path, _: path == "model", lambda _, model: _rebuilt(model))


@dataclasses.dataclass(frozen=True)
class Probe:
    """What one run of an experiment touched."""

    # Core lines it executed, `file:line` relative to axcore/.
    lines: frozenset[str]
    # The resolved config, flat, list indices dropped: path -> set of values.
    values: Mapping[str, frozenset]
    # Paths (indices dropped) of fields that hold a list of configs (per-layer lists).
    lists: frozenset[str]
    # Path (indices dropped) of every config node -> its registered name, or its class name.
    labels: Mapping[str, str]


def _run(experiment: str, plugins: Sequence[str], objects: Mapping[str, Any] | None) -> Any:
    """Resolves, builds and runs the shrunk experiment once; returns the Experiment."""
    overrides = [*PROBE_OVERRIDES, f"plugins=[{', '.join(plugins)}]"]
    exp = load_experiment(experiment, overrides, objects=dict(objects or {}))
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    model.parameter_specs()
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: np.asarray(0.02 * rng.normal(size=a.shape), a.dtype), model.abstract_parameters())
    ids = rng.integers(0, exp.config.model.vocab_size, size=(2, 8))
    with jax.disable_jit():  # Every line runs on every call: no trace is reused from a cache.
        outputs, _ = functional(model, params, ({"input_ids": ids, "target_labels": ids},), None, False)
    jax.block_until_ready(outputs)
    return exp


def _strip(path: str) -> str:
    return re.sub(r"\[\d+\]", "", path)


def probe(experiment: str, plugins: Sequence[str] = (), *, objects: Mapping[str, Any] | None = None) -> Probe:
    """Runs built-in `experiment` (shrunk) with `plugins` and records what it touched.

    The run is done twice and only the second is traced, so lines that run once per
    process (lazy per-class caches, first-time logging) count for no run, whatever
    ran before in the process.

    Raises:
        AxcoreError: the experiment does not resolve with these plugins (e.g. a
            transform that matches nothing).
    """
    _run(experiment, plugins, objects)
    with CoreLineTracer() as tracer:
        exp = _run(experiment, plugins, objects)
    values: dict[str, set] = collections.defaultdict(set)
    lists, labels = set(), {}
    for path, value in flatten(exp.config, exp.registries):
        values[_strip(path)].add(repr(value) if isinstance(value, (list, dict)) else value)
    for path, node in walk(exp.config):
        if isinstance(node, ConfigBase):
            name = exp.registries.name_of(node.target) if isinstance(node, InstantiableConfig) else None
            labels[_strip(path)] = name or type(node).__name__
        elif isinstance(node, list) and any(isinstance(v, ConfigBase) for v in node):
            lists.add(_strip(path))
    frozen = {p: frozenset(v) for p, v in values.items()}
    return Probe(tracer.relative(), frozen, frozenset(lists), labels)


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

    Shape presets such as `llama2_7b` list `plugins:` of their own and are left out.
    """
    return [name for name in builtin_experiments() if not read_experiment_file(name)[0].get("plugins")]


def core_usage(
    plugins: Sequence[str], experiments: Sequence[str] | None = None, *, objects: Mapping[str, Any] | None = None
) -> dict[str, CoreUsage]:
    """For each of `plugins`, run alone: the core lines only it runs and the core fields it writes.

    A core line counts for plugin P when some run with P executes it and no run
    without P does: over every experiment, the runs without plugins, with the
    do-nothing baseline plugin, and with each other plugin of `plugins`.

    Args:
        plugins: plugin names (installed, or keys of `objects`).
        experiments: built-in experiment names; None = `probe_experiments()`.
        objects: plugin objects by name, as for `load_experiment`.
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


def loc_report(families: list[str] | None = None) -> list[PluginLoc]:
    """One row per installed plugin (feature plugins and any others in the group)."""
    families = families or probe_experiments()
    loaded = {name: _load_entry_point(name, eps) for name, eps in sorted(installed_entry_points().items())}
    usage = core_usage(list(loaded), families)
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
    return rows


def _lines_cell(lines: frozenset[str] | None) -> str:
    """`0`, or the count and the files they are in: `3 (layers/position.py 2, module.py 1)`."""
    if lines is None:
        return "n/a"
    if not lines:
        return "0"
    files = collections.Counter(line.rpartition(":")[0] for line in lines)
    per_file = ", ".join(f"{f} {n}" for f, n in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{len(lines)} ({per_file})"


def format_table(rows: list[PluginLoc]) -> str:
    """A Markdown table of the report."""
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
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m axcore.tools.loc_report, the same table as `axcore loc`.
    sys.stdout.write(format_table(loc_report()))
