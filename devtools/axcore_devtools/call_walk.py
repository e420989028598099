"""The call walk of an axcore command: which modules the command's arguments pass through, and how
often the walk climbs back up a layer of the import-linter layers contract (issue 35).

    python -m axcore_devtools.call_walk -- train --set trainer.max_steps=2
    python -m axcore_devtools.call_walk -- generate RUN_DIR --prompt "The " --max-new-tokens 2

The command runs in-process (`axcore.cli.main(argv)`, or `--entry module:function`) under
`sys.setprofile`. The walk follows the `args` as data flow, not every call:

- Followed objects: the first `argparse.Namespace` an `axcore` function receives (the command's
  `args`) and what is derived from it through calls: a followed call's return value and, for a
  followed `__init__`, the object it built. A followed object brings its attributes (`__dict__`,
  `__slots__`) one level deep; containers (list, tuple, set, dict values) are transparent: their
  items are followed as the container is. Only containers, paths, namespaces and instances of
  classes defined in `axcore` (enum members aside) are followed; scalars, strings, arrays, classes
  and functions are shared by identity with unrelated code and never are.
- A followed call: a call of a Python function of an `axcore` module (the `--root` package) that
  receives a followed object as an argument (`self` included, `*args`/`**kwargs` looked into).
- Its caller: the innermost `axcore` frame under it; frames of other packages in between (pluggy,
  `functools`, `jax.tree.map` running an injected function) are skipped.
- A stop: a followed call whose module differs from its caller's; a stop equal to the one before it
  (same caller and callee modules) is collapsed. Modules visited: the callee modules of the stops.
- A climb: a stop from a module of a lower layer to one of a higher layer. A module belongs to the
  layer of the longest listed package containing it; the layers are the `layers` list of the first
  `layers` contract without `containers` in `[tool.importlinter]` of the pyproject.toml beside the
  root package, top first; names joined by `|` (or `:`) share a layer. A module of no listed
  package (`axcore/__init__.py`) has no layer and makes no climb.
- Leaves (`--leaves`, by default `LEAVES`: the config, module and layer machinery): a followed call
  into a leaf is a stop, but nothing under it is followed, so the walk shows how a command reaches
  the model, not the model's own inversion of control (configs instantiating the classes they
  name, `functional` calling a layer's methods), which `--leaves ''` counts too.
- Traced code is not walked: nothing is followed under a call that receives a JAX tracer. Only the
  main thread is profiled (sys.setprofile is per thread); the whole command runs (JAX compiles and
  steps included); nothing is followed before the namespace appears (parsing, plugin discovery).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import importlib
import json
import pathlib
import sys
import tomllib
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["LEAVES", "CallWalk", "contract_layers", "layer_of", "main", "walk_calls"]

# The default leaves: the model and config machinery, entered by a command but not walked into.
LEAVES = ("axcore.config", "axcore.module", "axcore.layers")

# Objects followed besides those of the root package's own classes.
_CONTAINERS = (argparse.Namespace, list, tuple, set, frozenset, dict, pathlib.PurePath)


@dataclasses.dataclass
class CallWalk:
    """The walk of one command: `stops` and `climbs` as (caller module, callee module) pairs."""

    # (caller module, callee module) for each stop, in call order, consecutive repeats collapsed.
    stops: list[tuple[str, str]]
    # The stops that go from a lower layer to a higher one, in call order.
    climbs: list[tuple[str, str]]
    # The callee modules of the stops, in first-visit order.
    modules: list[str]
    # The function each stop enters (`code.co_qualname`), one per stop.
    functions: list[str] = dataclasses.field(default_factory=list)
    # The command's return value (its exit status for `axcore.cli.main`).
    result: Any = None

    def report(self) -> str:
        """The walk as text: counts, then each climb (from -> to)."""
        climbs = set(self.climbs)
        kinds = collections.Counter((a, b, f) for (a, b), f in zip(self.stops, self.functions) if (a, b) in climbs)
        lines = [f"modules visited: {len(self.modules)}", f"stops: {len(self.stops)}", f"climbs: {len(self.climbs)}",
                 f"distinct climbs: {len(kinds)} (from -> to: the function entered, times)"]
        lines += [f"  {a} -> {b}: {f}  x{n}" for (a, b, f), n in kinds.items()]
        lines += ["modules:"] + [f"  {m}" for m in self.modules]
        return "\n".join(lines)


def contract_layers(pyproject: str | pathlib.Path) -> dict[str, int]:
    """Listed package -> layer index (0 = top) of the first top-level `layers` contract of `pyproject`.

    Raises ValueError naming the file when it has no such contract.
    """
    with open(pyproject, "rb") as f:
        config = tomllib.load(f)
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    for contract in contracts:
        if contract.get("type") == "layers" and not contract.get("containers"):
            layers: dict[str, int] = {}
            for index, entry in enumerate(contract["layers"]):
                for name in entry.replace(":", "|").split("|"):
                    layers[name.strip()] = index
            return layers
    raise ValueError(f"{pyproject}: no [[tool.importlinter.contracts]] of type 'layers' without 'containers'")


def layer_of(module: str, layers: Mapping[str, int]) -> int | None:
    """The layer index of `module`: that of the longest listed package containing it, None if none."""
    best, index = -1, None
    for package, layer in layers.items():
        if (module == package or module.startswith(package + ".")) and len(package) > best:
            best, index = len(package), layer
    return index


def _is_tracer(value: Any) -> bool:
    """Whether `value` is a JAX tracer (a class named Tracer in its MRO, defined under jax)."""
    return any(c.__name__ == "Tracer" and c.__module__.startswith("jax") for c in type(value).__mro__)


def _attributes(obj: Any) -> list[Any]:
    """The values of `obj`'s instance attributes (`__dict__` and set `__slots__`)."""
    items = list(getattr(obj, "__dict__", {}).values())
    for slot in getattr(type(obj), "__slots__", ()):
        try:
            items.append(getattr(obj, slot))
        except Exception:  # An unset slot, or a descriptor of a C type.
            continue
    return items


class _Walker:
    """The profile function: follows the namespace and what is derived from it (module docstring)."""

    def __init__(self, root: str, layers: Mapping[str, int], leaves: Sequence[str]):
        self.root = root
        self.leaves = tuple(leaves)
        self.layers = layers
        self.followed: dict[int, Any] = {}  # id -> object, kept alive so that ids are not reused.
        self.frames: dict[int, tuple[types.FrameType, str]] = {}  # (frame, "followed" | "leaf" | "traced").
        self.blocked = 0  # Leaf and traced frames on the stack: nothing under them is followed.
        self.stops: list[tuple[str, str]] = []
        self.functions: list[str] = []

    def in_root(self, frame: types.FrameType) -> bool:
        name = frame.f_globals.get("__name__", "")
        return name == self.root or name.startswith(self.root + ".")

    def followable(self, obj: Any) -> bool:
        """Containers, paths, namespaces and objects of classes defined in the root package."""
        if isinstance(obj, _CONTAINERS):
            return True
        if isinstance(obj, enum.Enum):
            return False
        module = type(obj).__module__ or ""
        return module == self.root or module.startswith(self.root + ".")

    def follow(self, obj: Any, parts: bool = True) -> None:
        """Follow `obj` and, if `parts`, its attributes one level deep; containers are transparent
        (a followed tuple's items are followed as the tuple is, with their attributes if `parts`)."""
        stack, seen = [(obj, parts)], set()
        while stack:
            obj, parts = stack.pop()
            if id(obj) in seen or not self.followable(obj):
                continue
            seen.add(id(obj))
            self.followed[id(obj)] = obj
            if isinstance(obj, dict):
                stack += [(item, parts) for item in obj.values()]
            elif isinstance(obj, list | tuple | set | frozenset):
                stack += [(item, parts) for item in obj]
            elif parts:
                stack += [(item, False) for item in _attributes(obj)]

    def arguments(self, frame: types.FrameType) -> list[Any]:
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount
        count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs.
        local = frame.f_locals
        values = [local[name] for name in code.co_varnames[:count] if name in local]
        for value in list(values):
            if isinstance(value, tuple | dict):
                values += list(value.values()) if isinstance(value, dict) else list(value)
        return values

    def caller(self, frame: types.FrameType) -> str | None:
        back = frame.f_back
        while back is not None and not self.in_root(back):
            back = back.f_back
        return None if back is None else back.f_globals["__name__"]

    def on_call(self, frame: types.FrameType) -> None:
        values = self.arguments(frame)
        if any(_is_tracer(v) for v in values):
            self.frames[id(frame)] = (frame, "traced")
            self.blocked += 1
            return
        if not self.followed:
            seed = next((v for v in values if isinstance(v, argparse.Namespace)), None)
            if seed is None:
                return
            self.follow(seed)
        if not any(id(v) in self.followed for v in values):
            return
        callee, caller = frame.f_globals["__name__"], self.caller(frame)
        leaf = any(callee == p or callee.startswith(p + ".") for p in self.leaves)
        self.frames[id(frame)] = (frame, "leaf" if leaf else "followed")
        self.blocked += leaf
        if caller is not None and caller != callee and (not self.stops or self.stops[-1] != (caller, callee)):
            self.stops.append((caller, callee))
            self.functions.append(frame.f_code.co_qualname)

    def on_return(self, frame: types.FrameType, value: Any) -> None:
        _, kind = self.frames.pop(id(frame))
        self.blocked -= kind != "followed"
        if kind == "traced":
            return
        self.follow(value)
        if frame.f_code.co_name == "__init__" and frame.f_code.co_argcount:
            self.follow(frame.f_locals.get(frame.f_code.co_varnames[0]))

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and not self.blocked and self.in_root(frame):
            self.on_call(frame)
        elif event == "return" and id(frame) in self.frames and self.frames[id(frame)][0] is frame:
            self.on_return(frame, arg)

    def result(self, value: Any) -> CallWalk:
        climbs = []
        for caller, callee in self.stops:
            low, high = layer_of(caller, self.layers), layer_of(callee, self.layers)
            if low is not None and high is not None and high < low:
                climbs.append((caller, callee))
        modules = list(dict.fromkeys(callee for _, callee in self.stops))
        return CallWalk(stops=list(self.stops), climbs=climbs, modules=modules, functions=list(self.functions),
                        result=value)


def walk_calls(
    entry: Callable[..., Any],
    args: Sequence[Any],
    *,
    root: str,
    layers: Mapping[str, int],
    leaves: Sequence[str] = (),
) -> CallWalk:
    """Run `entry(*args)` on this thread under the walker and return its walk (module docstring).

    `root`: the package whose modules are walked (`"axcore"`); `layers`: package -> layer index,
    0 = top (`contract_layers`); `leaves`: packages whose followed calls are stops but not walked
    into. The profile function is removed when `entry` returns or raises.
    """
    walker = _Walker(root, layers, leaves)
    previous = sys.getprofile()
    sys.setprofile(walker)
    try:
        value = entry(*args)
    finally:
        sys.setprofile(previous)
    return walker.result(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m axcore_devtools.call_walk",
        description="Walk an axcore command's calls: modules visited, stops and climbs up the layers.",
    )
    parser.add_argument("--entry", default="axcore.cli:main", help="module:function run with the command's argv")
    parser.add_argument("--root", default="axcore", help="the package whose modules are walked")
    parser.add_argument("--pyproject", default=None,
                        help="the pyproject.toml holding the layers contract (default: beside the root package)")
    parser.add_argument("--leaves", default=",".join(LEAVES),
                        help="comma-separated packages entered but not walked into ('' walks everything)")
    parser.add_argument("--json", action="store_true", help="print the walk as one JSON object")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command's argv, after `--`")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Walk the command given after `--` and print the walk; returns the command's exit status."""
    options = _parser().parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    module, _, function = options.entry.partition(":")
    entry = getattr(importlib.import_module(module), function)
    pyproject = options.pyproject
    if pyproject is None:
        package = importlib.import_module(options.root)
        pyproject = pathlib.Path(package.__file__).resolve().parents[1] / "pyproject.toml"
    leaves = [p for p in options.leaves.split(",") if p]
    walk = walk_calls(entry, [list(command)], root=options.root, layers=contract_layers(pyproject), leaves=leaves)
    if options.json:
        print(json.dumps({"modules": walk.modules, "stops": walk.stops, "functions": walk.functions,
                          "climbs": walk.climbs}))
    else:
        print(walk.report())
    return walk.result if isinstance(walk.result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
