"""Valid ranges and sets of config fields, and the pass that checks a whole tree.

A field declares its range with `typing.Annotated`; assignment still checks only
the type, and `validate_config` checks every range of a tree at once, so that a
user sees all problems of an experiment in one pass:

    class Config(Configurable.Config):
        # Model dimension.
        dim: Annotated[int, Positive] = REQUIRED
        # Dropout probability.
        dropout_rate: Annotated[float, Probability] = 0.0
        # Optional: None, or a positive int.
        window: Annotated[int, Positive] | None = None

Every float field must hold a finite value unless annotated `AllowNonFinite`.
A config class adds checks across its fields by overriding
`ConfigBase.check_fields()` (yielding `(field, problem)` pairs).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

from axcore.config.base import REQUIRED, ConfigBase
from axcore.errors import ConfigError


class ConfigValidationError(ConfigError):
    """An experiment has one or more out-of-range or inconsistent values.

    `problems` holds one line per problem, each naming its dotted config path; the
    CLI prints each on its own line.
    """

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        super().__init__(f"{problems[0]}{more}")


class Constraint:
    """A condition on a field's value; `problem(value)` says what is wrong, or None."""

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Range(Constraint):
    """Numeric bounds; `None` leaves a side open."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def describe(self) -> str:
        parts = []
        if self.gt is not None:
            parts.append(f"> {self.gt:g}")
        if self.ge is not None:
            parts.append(f">= {self.ge:g}")
        if self.lt is not None:
            parts.append(f"< {self.lt:g}")
        if self.le is not None:
            parts.append(f"<= {self.le:g}")
        return " and ".join(parts)

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return None  # Types are checked on assignment, NaN by the finiteness check.
        ok = (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )
        return None if ok else f"must be {self.describe()}"


@dataclasses.dataclass(frozen=True)
class Matches(Constraint):
    """A string fully matching `pattern`; `hint` says in words what is allowed."""

    pattern: str
    hint: str

    def problem(self, value: Any) -> str | None:
        if isinstance(value, str) and re.fullmatch(self.pattern, value) is None:
            return f"must be {self.hint}"
        return None


@dataclasses.dataclass(frozen=True)
class MaxLength(Constraint):
    """A string, list or mapping of at most `limit` items."""

    limit: int

    def problem(self, value: Any) -> str | None:
        if hasattr(value, "__len__") and len(value) > self.limit:
            return f"must have at most {self.limit} items (characters), has {len(value)}"
        return None


class _AllowNonFinite(Constraint):
    def problem(self, value: Any) -> str | None:
        return None


# Sizes and counts: > 0.
Positive = Range(gt=0)
# Offsets, counts that may be zero ("0 disables"): >= 0.
NonNegative = Range(ge=0)
# Probabilities of dropping or masking: [0, 1).
Probability = Range(ge=0, lt=1)
# Fractions and mixing weights: [0, 1].
UnitInterval = Range(ge=0, le=1)
# Seeds of JAX's PRNG (a uint32 pair from an integer below 2**32 here).
Seed = Range(ge=0, lt=2**32)
# A float field that may hold inf or NaN (every other float must be finite).
AllowNonFinite = _AllowNonFinite()


def _split(tp: Any) -> tuple[Any, tuple[Constraint, ...]]:
    """`Annotated[T, c...]` -> `(T, (c...))`; other annotations -> `(tp, ())`."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *meta = typing.get_args(tp)
        return base, tuple(m for m in meta if isinstance(m, Constraint))
    return tp, ()


def strip_constraints(tp: Any) -> Any:
    """The annotation without its `Annotated` constraints (what assignment checks)."""
    return _split(tp)[0]


def _value_problems(value: Any, tp: Any, path: str) -> Iterator[str]:
    """Problems of `value` under annotation `tp` (constraints, finiteness), descending into containers."""
    tp, constraints = _split(tp)
    if value is REQUIRED or value is None or isinstance(value, ConfigBase):
        return
    if isinstance(value, float) and not math.isfinite(value) and AllowNonFinite not in constraints:
        yield f"'{path}' must be a finite number, got {value}."
        return
    for constraint in constraints:
        problem = constraint.problem(value)
        if problem is not None:
            shown = value if not isinstance(value, str) or len(value) <= 60 else value[:57] + "..."
            yield f"'{path}' {problem}, got {shown!r}."
            return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            yield from _value_problems(value, members[0], path)
        else:  # Several members: check against the one the value's type picked.
            for member in members:
                kind = typing.get_origin(strip_constraints(member)) or strip_constraints(member)
                if isinstance(kind, type) and isinstance(value, kind):
                    yield from _value_problems(value, member, path)
                    break
    elif isinstance(value, (list, tuple)) and args:
        elems = args if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis) else None
        for i, item in enumerate(value):
            item_tp = elems[i] if elems and i < len(elems) else args[0]
            yield from _value_problems(item, item_tp, f"{path}[{i}]")
    elif isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            yield from _value_problems(item, args[1], f"{path}.{key}")
    elif isinstance(value, (list, tuple, dict)):
        yield from _untyped_problems(value, path)


def _untyped_problems(value: Any, path: str) -> Iterator[str]:
    """Non-finite floats inside containers whose items are not typed (e.g. dict[str, Any])."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}"
        if isinstance(item, float) and not math.isfinite(item):
            yield f"'{where}' must be a finite number, got {item}."
        elif isinstance(item, (list, tuple, dict)):
            yield from _untyped_problems(item, where)


def config_problems(cfg: ConfigBase, path: str = "") -> list[str]:
    """Every problem of the tree: field constraints, non-finite floats, `check_fields()`.

    One line per problem, each starting with the quoted dotted path of its field.
    Unset REQUIRED fields are not problems here (a parent may still set them).
    """
    problems: list[str] = []
    _collect(cfg, path, problems)
    return problems


def _collect(cfg: ConfigBase, path: str, problems: list[str]) -> None:
    types_ = type(cfg).field_types()
    prefix = f"{path}." if path else ""
    for name, value in cfg.items():
        where = f"{prefix}{name}"
        problems.extend(_value_problems(value, types_[name], where))
        if isinstance(value, ConfigBase):
            _collect(value, where, problems)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, ConfigBase):
                    _collect(item, f"{where}[{i}]", problems)
    for field, problem in cfg.check_fields():
        problems.append(f"'{prefix}{field}' {problem}")


def validate_config(cfg: ConfigBase, path: str = "") -> None:
    """Raises ConfigValidationError listing every problem `config_problems` finds."""
    problems = config_problems(cfg, path)
    if problems:
        raise ConfigValidationError(problems)
