"""The model-family rows of `axcore loc`: what each registered converter (a Hugging Face
`model_type` a plugin supports, e.g. `mistral`) costs, and which core mechanisms it uses.

Columns are described in `axcore_devtools.loc_report`'s module docstring. A converter
takes part in the core-line and mechanism columns when it offers `example_config()`
(a tiny config.json as a dict); otherwise those cells are `n/a`.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import tempfile
import typing
from typing import Any

import yaml

from axcore.config import ConfigBase, DType, InstantiableConfig, Width, walk
from axcore.experiment.files import search_plugins
from axcore.experiment.loading import load_experiment
from axcore.plugin.loading import installed_entry_points, load_plugin

from axcore_devtools.loc_probe import _helpers, _hookimpls, _lines_cell, body_lines, probe

CONVERTER_HOOK = "axcore_register_model_converters"
# The run of a family's example model (its own shapes; one device).
FAMILY_OVERRIDES = ("mesh.instance_type=cpu-1",)


@dataclasses.dataclass
class FamilyLoc:
    # The outside model type (Hugging Face `model_type`).
    model_type: str
    # The plugin registering its converter, and that plugin's distribution.
    plugin: str
    distribution: str
    # Body lines of the plugin's converter-registering hook (shared by its families).
    hook_lines: int
    # Code lines of the converter's own methods and the plugin-package functions they call.
    helper_lines: int
    # Core lines its example model runs and no other run does; None without an example.
    core_lines: frozenset[str] | None
    # Core switches its model sets beyond the default experiment's, sorted; None without an example.
    core_mechanisms: tuple[str, ...] | None


def _is_size_or_dtype(tp: Any) -> bool:
    """Whether an annotation is a size (the `Width` constraint: head counts, dimensions) or a dtype
    (a numeric policy, not a mechanism)."""
    if tp is DType or any(m is Width for m in getattr(tp, "__metadata__", ())):
        return True
    return any(_is_size_or_dtype(arg) for arg in typing.get_args(tp))


def _component(value: Any) -> Any:
    if isinstance(value, list):
        return "per-layer list"
    return value.target if isinstance(value, InstantiableConfig) else value


def core_switches(experiment: Any) -> set[str]:
    """`<component>.<field>` for each switch the resolved model sets: a field off by default (False, None,
    0) turned on (sizes and dtypes aside), a component slot filled, emptied or given another component."""
    out = set()
    registries = experiment.registries
    for _, node in walk(experiment.config.model):
        if not isinstance(node, ConfigBase):
            continue
        label = (registries.name_of(node.target) if isinstance(node, InstantiableConfig) else None) or type(node).__name__
        defaults, types = type(node)._validated_defaults(), type(node).field_types()
        for field, value in node.items():
            default = defaults[field]
            if isinstance(default, InstantiableConfig) or isinstance(value, (InstantiableConfig, list)):
                changed = _component(value) != _component(default)
            else:  # Off by default (False, None, 0), on here.
                off = default is None or (isinstance(default, (bool, int, float)) and not default)
                changed = off and bool(value) and not _is_size_or_dtype(types[field])
            if changed:
                out.add(f"{label}.{field}")
    return out


def _family_probe(model_type: str, converter: Any) -> tuple[Any, Any] | None:
    """(Probe, Experiment) of the converter's example model, or None if it has no example."""
    example = getattr(converter, "example_config", None)
    if example is None:
        return None
    data = {"name": f"loc-{model_type}", **converter.experiment(example(), f"{model_type} example config.json")}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "experiment.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False), "utf-8")
        found = probe(str(path), overrides=FAMILY_OVERRIDES)
        return found, load_experiment(path, list(FAMILY_OVERRIDES))


def _converter_lines(converter: Any, package: str) -> int:
    functions = set()
    for klass in type(converter).__mro__:
        if (klass.__module__ or "").split(".")[0] != package:
            continue
        for value in vars(klass).values():
            if inspect.isfunction(value) and value.__code__.co_filename == inspect.getfile(klass):  # Not generated.
                functions |= {value, *_helpers(value, package)}
    return sum(body_lines(fn) for fn in functions)


def family_report(seen_lines: set[str] | frozenset[str] = frozenset(), baseline: str = "default") -> list[FamilyLoc]:
    """One row per registered model converter of an installed plugin, sorted by model type.

    Args:
        seen_lines: core lines of the other runs (the plugin table's; `core_usage(seen_lines=...)`).
        baseline: the built-in experiment whose switches are everyone's (not counted as mechanisms).
    """
    found = search_plugins("model_converters").found
    eps = installed_entry_points()
    base = core_switches(load_experiment(baseline, list(FAMILY_OVERRIDES)))
    probes, rows = {}, []
    for model_type in sorted(found):
        plugin_name = found[model_type].provenance.plugin
        if plugin_name not in eps:
            continue
        probes[model_type] = _family_probe(model_type, found[model_type].value)
    for model_type, result in probes.items():
        entry = found[model_type]
        plugin, dist, _ = load_plugin(entry.provenance.plugin, eps[entry.provenance.plugin])
        package = (getattr(plugin, "__package__", None) or getattr(plugin, "__name__", "")).split(".")[0]
        hook = _hookimpls(plugin).get(CONVERTER_HOOK)
        lines = mechanisms = None
        if result is not None:
            others = frozenset().union(*(r[0].lines for t, r in probes.items() if r is not None and t != model_type))
            lines = result[0].lines - others - frozenset(seen_lines)
            mechanisms = tuple(sorted(core_switches(result[1]) - base))
        rows.append(
            FamilyLoc(
                model_type=model_type,
                plugin=entry.provenance.plugin,
                distribution=dist,
                hook_lines=body_lines(hook) if hook is not None else 0,
                helper_lines=_converter_lines(entry.value, package),
                core_lines=lines,
                core_mechanisms=mechanisms,
            )
        )
    return rows


def format_family_table(rows: list[FamilyLoc]) -> str:
    """A Markdown table of the model-family rows."""
    header = ["model family", "plugin", "distribution", "hook LoC", "helper LoC", "core lines only it runs",
              "core mechanisms used"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        mechanisms = "n/a" if r.core_mechanisms is None else ", ".join(f"`{m}`" for m in r.core_mechanisms)
        cells = [r.model_type, r.plugin, r.distribution, str(r.hook_lines), str(r.helper_lines),
                 _lines_cell(r.core_lines), mechanisms or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["FamilyLoc", "core_switches", "family_report", "format_family_table"]
