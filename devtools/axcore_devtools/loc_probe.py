"""The measuring instruments of `axcore loc`: code lines of functions, and traced runs of
experiments recording which core lines execute (`probe`). Used by the plugin table
(`axcore_devtools.loc_report`) and the model-family table (`axcore_devtools.family_loc`).
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
from axcore.experiment.loading import load_experiment
from axcore.module import functional

CORE_ROOT = pathlib.Path(axcore.__file__).parent
# Shrink every built-in experiment for the traced runs (moe needs two layers).
PROBE_OVERRIDES = (
    "mesh.instance_type=cpu-1",
    "model.num_layers=2",
    "model.dim=32",
    "model.decoder.layer.self_attention.num_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=64",
)


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


def _run(
    experiment: str, plugins: Sequence[str], objects: Mapping[str, Any] | None, overrides: Sequence[str] | None = None
) -> Any:
    """Resolves, builds and runs the experiment once (shrunk by `PROBE_OVERRIDES` with `plugins`, unless
    `overrides` are given instead); returns the Experiment."""
    if overrides is None:
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


def probe(
    experiment: str,
    plugins: Sequence[str] = (),
    *,
    objects: Mapping[str, Any] | None = None,
    overrides: Sequence[str] | None = None,
) -> Probe:
    """Runs built-in `experiment` (shrunk) with `plugins` and records what it touched.

    The run is done twice and only the second is traced, so lines that run once per
    process (lazy per-class caches, first-time logging) count for no run, whatever
    ran before in the process.

    Raises:
        AxcoreError: the experiment does not resolve with these plugins (e.g. a
            transform that matches nothing).
    """
    _run(experiment, plugins, objects, overrides)
    with CoreLineTracer() as tracer:
        exp = _run(experiment, plugins, objects, overrides)
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


def _lines_cell(lines: frozenset[str] | None) -> str:
    """`0`, or the count and the files they are in: `3 (layers/position.py 2, module.py 1)`."""
    if lines is None:
        return "n/a"
    if not lines:
        return "0"
    files = collections.Counter(line.rpartition(":")[0] for line in lines)
    per_file = ", ".join(f"{f} {n}" for f, n in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{len(lines)} ({per_file})"
