"""Kernel registry: implementations of an op chosen by priority and `is_supported`.

Each op ("attention", "rms_norm", ...) has candidate kernels. `select()` tries them
in descending priority (ties broken by name, so registration and install order never
decide), logs why each declining kernel declined (once per op, kernel and reason),
and returns the first that supports the problem. A reference kernel that supports
everything is the fallback.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol, runtime_checkable

from axcore.errors import KernelNotSupportedError, UnknownComponentError, did_you_mean
from axcore.registry import Provenance, Registry

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Support:
    """A kernel's answer to `is_supported`: ok, or the reason it declines."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


@runtime_checkable
class Kernel(Protocol):
    """One implementation of an op.

    `name` identifies it (configs may force it by name); higher `priority` is tried
    first; `is_supported(problem)` returns a `Support`; calling it computes the op.
    """

    name: str
    priority: int

    def is_supported(self, problem: Any) -> Support: ...

    def __call__(self, *args, **kwargs) -> Any: ...


def _validate_kernel(name: str, value: Any) -> str | None:
    if not isinstance(value, Kernel):
        return "expected an object with name, priority, is_supported() and __call__()"
    if value.name != name:
        return f"its name attribute is {value.name!r}"
    return None


class KernelRegistry:
    """Op name -> registry of kernels for that op."""

    def __init__(self):
        self._ops: dict[str, Registry[Kernel]] = {}
        # (op, kernel, reason) already logged: every layer selects at trace time, so
        # a declining kernel would otherwise log once per layer and per trace.
        self._logged_declines: set[tuple[str, str, str]] = set()

    def register(self, op: str, kernel: Kernel, provenance: Provenance, override: bool = False) -> None:
        registry = self._ops.setdefault(op, Registry(f"'{op}' kernel", _validate_kernel))
        registry.register(getattr(kernel, "name", None), kernel, provenance, override)

    def ops(self) -> list[str]:
        return sorted(self._ops)

    def candidates(self, op: str) -> list[Kernel]:
        """Kernels for `op` in the order `select` tries them."""
        registry = self._ops.get(op)
        if registry is None:
            raise UnknownComponentError(
                f"No kernels registered for op '{op}'{did_you_mean(op, self._ops)}; ops: "
                f"{', '.join(self.ops())}."
            )
        kernels = [registry[name] for name in registry]
        return sorted(kernels, key=lambda k: (-k.priority, k.name))

    def select(self, op: str, problem: Any, requested: str | None = None) -> Kernel:
        """The kernel to run `op` on `problem`.

        Args:
            op: the op name.
            problem: op-specific description (shapes, dtypes, flags, platform).
            requested: a kernel name to force; it must support the problem.

        Raises:
            KernelNotSupportedError: the requested kernel declines, or every kernel does.
        """
        if requested is not None:
            kernel = self._ops[op][requested] if op in self._ops else None
            if kernel is None:
                self.candidates(op)  # Raises for an unknown op.
            support = kernel.is_supported(problem)
            if not support:
                raise KernelNotSupportedError(
                    f"The '{op}' kernel '{requested}' does not support this problem: "
                    f"{support.reason}. Remove the explicit kernel choice to fall back."
                )
            return kernel
        reasons = []
        for kernel in self.candidates(op):
            support = kernel.is_supported(problem)
            if support:
                return kernel
            if (op, kernel.name, support.reason) not in self._logged_declines:
                self._logged_declines.add((op, kernel.name, support.reason))
                logger.info("'%s' kernel '%s' declined: %s", op, kernel.name, support.reason)
            reasons.append(f"{kernel.name}: {support.reason}")
        raise KernelNotSupportedError(f"No '{op}' kernel supports this problem ({'; '.join(reasons)}).")
