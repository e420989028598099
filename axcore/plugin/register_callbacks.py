"""The `register` callbacks that registration hooks receive, as typed Protocols.

Every `axcore_register_*` hookspec (axcore/plugin/hookspecs.py) takes one `register`
argument; these Protocols state its call signature so a plugin author's editor and
type checker see it. The registry behind each callback validates and deduplicates
(`axcore.registry`); nothing here runs at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from axcore.kernels.registry import Kernel, Op

__all__ = ["RegisterCommand", "RegisterComponent", "RegisterKernel", "RegisterNamed"]


class RegisterComponent(Protocol):
    """`register(name, component, *, override=False)`: a component under a name (layers, backends, ...)."""

    def __call__(self, name: str, component: Any, *, override: bool = False) -> None: ...


class RegisterKernel(Protocol):
    """`register(op, kernel, *, override=False)`: a kernel of a declared op (the op or its name)."""

    def __call__(self, op: Op | str, kernel: Kernel, *, override: bool = False) -> None: ...


class RegisterNamed(Protocol):
    """`register(value, *, override=False)`: a value that carries its own name (ops, mesh rules, kernels of one op)."""

    def __call__(self, value: Any, *, override: bool = False) -> None: ...


class RegisterCommand(Protocol):
    """`register(name, run, *, add_arguments=None, help="", override=False)`: a sub-command of `axcore`."""

    def __call__(
        self, name: str, run: Any, *, add_arguments: Any = None, help: str = "", override: bool = False
    ) -> None: ...
