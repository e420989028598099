"""PEP 562 lazy re-exports, so importing a package does not import heavy modules.

A package states each public name once: in the `__all__` of the module that defines it.
`module_exports` reads those lists from the modules' source (without importing them), so
the package's lazy map and its own `__all__` derive from them.
"""

from __future__ import annotations

import ast
import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def declared_all(path: str) -> list[str]:
    """The literal `__all__ = [...]` of the Python source at `path`, read without importing it.

    Raises ValueError when the module states no literal `__all__` (a package re-exporting
    it must have one to derive from).
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                raise ValueError(f"{path}: __all__ is not a literal list of names") from None
    raise ValueError(f"{path} states no literal __all__")


def module_exports(namespace: Mapping[str, Any], modules: Iterable[str]) -> dict[str, str]:
    """Name -> defining module for every name in the `__all__` of each of `modules`.

    `namespace` is the package's globals() (its `__name__` and `__file__`); `modules`
    are submodule names relative to it (`"loading"` in `axcore.plugin`).
    """
    folder = os.path.dirname(namespace["__file__"])
    where: dict[str, str] = {}
    for module in modules:
        for name in declared_all(os.path.join(folder, module + ".py")):
            where[name] = f"{namespace['__name__']}.{module}"
    return where


def lazy_exports(namespace: dict[str, Any], where: Mapping[str, str]) -> tuple[Callable, Callable]:
    """Module `__getattr__` and `__dir__` that import `where[name]` on first use of `name`.

    The value is cached in `namespace` (the package's globals()), so later lookups are
    ordinary attribute access.
    """

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
