"""`axcore loc`: what each installed feature plugin costs to integrate, computed from code.

For every plugin in the `axcore` entry-point group this reports, in the spirit of
the AXLearn paper's LoC-complexity table:

- hook LoC: lines of the bodies of its config-transform hook implementations (the
  integration) and of all its hook implementations; docstrings, comments and blank
  lines do not count;
- axcore/ lines: lines of code under `axcore/` that name the plugin, its package or
  anything it defines (docstrings and comments excluded); a feature that needed a
  core change shows it here;
- layers touched per built-in model family: modules of the instantiated model
  (each built-in experiment) that the plugin adds, removes or reconfigures.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re
import textwrap
from typing import Any

import axcore
from axcore.config import ConfigBase, InstantiableConfig
from axcore.plugins import _load_entry_point, installed_entry_points

TRANSFORM_HOOK = "axcore_transform_config"


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
    # Lines of code under axcore/ that refer to the plugin.
    core_lines: int
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


def _defined_names(plugin: Any) -> set[str]:
    module = inspect.getmodule(plugin) or plugin
    package = (getattr(module, "__package__", None) or module.__name__).split(".")[0]
    names = {package}
    for obj in vars(module).values():
        owner = getattr(obj, "__module__", "") or ""
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and owner.split(".")[0] == package:
            if not obj.__name__.startswith("axcore_"):
                names.add(obj.__name__)
    return names


def core_reference_lines(words: set[str], root: pathlib.Path | None = None) -> int:
    """Lines of code under axcore/ (docstrings and comments excluded) naming any of `words`."""
    root = root or pathlib.Path(axcore.__file__).parent
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in sorted(words)) + r")\b", re.I)
    hits = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text("utf-8"))
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            text = None
            if isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                text = node.name
            elif isinstance(node, ast.alias):
                text = node.name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            if text and pattern.search(text):
                hits.add((path, node.lineno))
    return len(hits)


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
    from axcore.experiment import load_experiment

    models = []
    for overrides in ([], [f"plugins=[{plugin}]"]):
        exp = load_experiment(experiment_name, ["mesh.instance_type=cpu-1", *overrides])
        models.append(_modules(exp.config.model.instantiate(name="model", registries=exp.registries)))
    before, after = models
    touched = set(before) ^ set(after)
    touched |= {p for p in set(before) & set(after) if _module_signature(before[p]) != _module_signature(after[p])}
    return len(touched)


def loc_report(families: list[str] | None = None) -> list[PluginLoc]:
    """One row per installed plugin (feature plugins and any others in the group)."""
    from axcore.experiment import builtin_experiments

    families = families or builtin_experiments()
    rows = []
    for name, eps in sorted(installed_entry_points().items()):
        plugin, dist, _ = _load_entry_point(name, eps)
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
                core_lines=core_reference_lines(_defined_names(plugin) | {name}),
                touched=touched,
            )
        )
    return rows


def format_table(rows: list[PluginLoc]) -> str:
    """A Markdown table of the report."""
    families = list(rows[0].touched) if rows else []
    header = ["plugin", "distribution", "transform hook LoC", "+ its helpers", "all hooks LoC", "axcore/ lines"]
    header += [f"layers touched ({f})" for f in families]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.name, r.distribution, str(r.integration_lines), str(r.integration_with_helpers)]
        cells += [str(r.hook_lines), str(r.core_lines)]
        cells += [str(r.touched[f]) for f in families]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
