"""PEP 562 lazy re-exports, so importing a package does not import heavy modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


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
