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

Every float field must hold a finite value unless annotated `AllowNonFinite`, and
every int a value of the int64 range (what NumPy and XLA can hold). A config class
adds checks across its fields by overriding `ConfigBase.check_fields()` (yielding
`(field, problem)` pairs).

Sizes. A field whose value sizes an array or counts parts built one by one declares
a `Size` (core and plugin layers alike), with an upper bound as well as a lower one:

    # Vocabulary size.
    vocab_size: Annotated[int, Length] = REQUIRED   # 1 .. 2**31 - 1 (int32 token ids)
    # Model dimension.
    dim: Annotated[int, Width] = REQUIRED           # 1 .. 2**20
    # Number of decoder layers.
    num_layers: Annotated[int, Depth] = REQUIRED    # 1 .. 1024 (one module each)

`size_problems` checks only these bounds and the int64 range, cheaply, before the
plugins' config transforms run (a transform may build one config per layer), and
`config_problems` checks them again with everything else before a model is built.
A dtype field of values that are differentiated (parameters, activations) declares
`Floating`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from axcore.config.base import REQUIRED, ConfigBase
from axcore.errors import ConfigError, one_line

__all__ = [
    "AllowNonFinite",
    "AtLeastSetting",
    "ConfigValidationError",
    "Constraint",
    "Depth",
    "Floating",
    "LearningRate",
    "Length",
    "Matches",
    "MaxLength",
    "NonNegative",
    "PeakRate",
    "Positive",
    "Probability",
    "Range",
    "Seed",
    "Size",
    "UnitInterval",
    "Width",
    "config_problems",
    "config_warnings",
    "raise_collected",
    "setting_problems",
    "size_problems",
    "validate_config",
]


class ConfigValidationError(ConfigError):
    """An experiment has one or more out-of-range or inconsistent values.

    `problems` holds one line per problem, each naming its dotted config path; the
    CLI prints each on its own line.
    """

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        super().__init__(f"{problems[0]}{more}")


def raise_collected(errors: Sequence[ConfigError]) -> None:
    """Raises the errors collected in one pass (e.g. by `from_dict(..., errors=...)`), if any.

    One error is raised as itself (its type kept); several as one ConfigValidationError
    holding one line per error, which the CLI prints one under the other.
    """
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigValidationError([one_line(e) for e in errors])


class Constraint:
    """A condition on a field's value; `problem(value)` says what is wrong, or None."""

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError

    def advice(self, value: Any) -> str | None:
        """What to do about a `value` that has a problem (appended to the line), or None."""
        return None

    def warning(self, value: Any) -> str | None:
        """Why an allowed `value` is unusual enough to warn about (`config_warnings`), or None."""
        return None


@dataclasses.dataclass(frozen=True)
class AtLeastSetting(Constraint):
    """At least the experiment's value at `setting` (a dotted path from the root, e.g. `input.seq_len`).

    A check across sections, so the field alone accepts any value; `setting_problems` runs it
    on a whole experiment (e.g. a learned position table's `max_len` against the sequence length).
    """

    # Dotted path of the setting, from the experiment's root.
    setting: str
    # Why the field must cover the setting (a clause, shown after the numbers).
    why: str

    def problem(self, value: Any) -> str | None:
        return None


def setting_problems(root: ConfigBase, section: str) -> list[str]:
    """Problems of every `AtLeastSetting` field under `root.<section>`, measured against `root`."""
    problems: list[str] = []

    def setting(path: str) -> Any:
        value: Any = root
        for part in path.split("."):
            value = getattr(value, part, None)
        return value

    def visit(cfg: ConfigBase, path: str) -> None:
        types_ = type(cfg).field_types()
        for name, value in cfg.items():
            where = f"{path}.{name}"
            for c in split_constraints(types_[name])[1]:
                limit = setting(c.setting) if isinstance(c, AtLeastSetting) else None
                if isinstance(value, int) and isinstance(limit, int) and value < limit:
                    problems.append(
                        f"'{where}' ({value}) must be >= '{c.setting}' ({limit}): {c.why}; raise {name} or lower "
                        f"{c.setting.rsplit('.', 1)[-1]}."
                    )
            items = [(value, where)] if isinstance(value, ConfigBase) else []
            if isinstance(value, (list, tuple)):
                items = [(item, f"{where}[{i}]") for i, item in enumerate(value) if isinstance(item, ConfigBase)]
            for item, item_path in items:
                visit(item, item_path)

    visit(getattr(root, section), section)
    return problems


@dataclasses.dataclass(frozen=True)
class Range(Constraint):
    """Numeric bounds; `None` leaves a side open."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    # What to do about a value out of range (appended to the problem's line), if anything is worth saying.
    hint: str | None = None

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

    def advice(self, value: Any) -> str | None:
        return self.hint


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


@dataclasses.dataclass(frozen=True)
class Size(Constraint):
    """An int size or count from `minimum` to `limit`; `why` says where the limit comes from."""

    limit: int
    why: str
    minimum: int = 1

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool) or self.minimum <= value <= self.limit:
            return None  # Types are checked on assignment.
        return f"must be an integer from {self.minimum} to {self.limit} ({self.why})"

    def advice(self, value: Any) -> str:
        return "set a smaller value" if value > self.limit else f"set at least {self.minimum}"


@dataclasses.dataclass(frozen=True)
class PeakRate(Range):
    """A peak rate a schedule scales (a learning rate): in `(0, le]`, with a warning above `warn_above`.

    Zero (also what a literal such as 1e-400 underflows to) trains nothing; past `le` the
    first update of unit-scale weights is larger than the weights themselves, so the
    run diverges to NaN while exiting normally.
    """

    warn_above: float = 1.0

    def advice(self, value: Any) -> str:
        small = " (a literal as small as 1e-400 reads as 0)" if value == 0 else ""
        return f"typical peak learning rates lie between 1e-5 and 1e-2{small}"

    def warning(self, value: Any) -> str | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > self.warn_above:
            return f"is {value:g}, above {self.warn_above:g}; such a run usually diverges ({self.advice(value)})"
        return None


class _Floating(Constraint):
    """A floating dtype (float32, bfloat16, float16, float8 types): values that are differentiated."""

    def problem(self, value: Any) -> str | None:
        import jax.numpy as jnp  # Deferred, as in axcore.config.base: declaring configs needs no JAX.

        if not isinstance(value, np.dtype) or jnp.issubdtype(value, jnp.floating):
            return None
        return "must be a floating dtype (gradients flow through these values)"

    def advice(self, value: Any) -> str:
        return "use float32, bfloat16 or float16"


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
# Peak learning rates: > 0 and <= 10, a warning above 1.
LearningRate = PeakRate(gt=0, le=10)
# Seeds of JAX's PRNG (a uint32 pair from an integer below 2**32 here).
Seed = Range(ge=0, lt=2**32)
# A float field that may hold inf or NaN (every other float must be finite).
AllowNonFinite = _AllowNonFinite()
# Lengths indexed by token ids or positions (vocabulary, sequence, position table), batch sizes and
# other array dimensions: JAX's default integer is int32, so an index past 2**31 - 1 wraps.
Length = Size(2**31 - 1, "token ids and positions are int32")
# Feature widths: model, hidden and head dims, heads, experts (host tables such as RoPE's or ALiBi's
# are computed per feature or head when the model is traced).
Width = Size(2**20, "a 2**20-wide square weight matrix alone holds 2**40 parameters, 4 TiB in float32")
# Parts built one by one in Python (decoder layers, unrolled scan steps): each is a module of its own,
# built and traced apart (`axcore config` of 1024 unrolled layers: about 0.4 GB and 25 s on 2 CPU cores).
Depth = Size(1024, "each layer is built and traced as a module of its own; the deepest published decoders have under 200")
# A dtype of parameters or activations.
Floating = _Floating()

# Values every int field must lie in: what NumPy, JAX and XLA can hold (int64).
_INT64 = (-(2**63), 2**63 - 1)


def split_constraints(tp: Any) -> tuple[Any, tuple[Constraint, ...]]:
    """`Annotated[T, c...]` -> `(T, (c...))`; other annotations -> `(tp, ())`."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *meta = typing.get_args(tp)
        return base, tuple(m for m in meta if isinstance(m, Constraint))
    return tp, ()


def strip_constraints(tp: Any) -> Any:
    """The annotation without its `Annotated` constraints (what assignment checks)."""
    return split_constraints(tp)[0]


def _shown(value: Any) -> str:
    if isinstance(value, np.dtype):
        return repr(value.name)
    return repr(value if not isinstance(value, str) or len(value) <= 60 else value[:57] + "...")


def _value_problems(value: Any, tp: Any, path: str, sizes_only: bool = False) -> Iterator[str]:
    """Problems of `value` under annotation `tp` (constraints, finiteness, the int64 range), descending
    into containers; with `sizes_only`, only `Size` constraints and the int64 range."""
    tp, constraints = split_constraints(tp)
    if value is REQUIRED or value is None or isinstance(value, ConfigBase):
        return
    past_int64 = isinstance(value, int) and not isinstance(value, bool) and not _INT64[0] <= value <= _INT64[1]
    if sizes_only and not past_int64:  # A value past int64 is a problem anyway: its own range names it best.
        constraints = tuple(c for c in constraints if isinstance(c, Size))
    elif not sizes_only and isinstance(value, float) and not math.isfinite(value) and AllowNonFinite not in constraints:
        yield f"'{path}' must be a finite number, got {value}."
        return
    for constraint in constraints:
        problem = constraint.problem(value)
        if problem is not None:
            advice = constraint.advice(value)
            yield f"'{path}' {problem}, got {_shown(value)}{f'; {advice}' if advice else ''}."
            return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if past_int64 and not (origin is typing.Union or origin is types.UnionType):  # A member's own range first.
        yield f"'{path}' must be an integer from {_INT64[0]} to {_INT64[1]} (int64), got {value}; set one in that range."
    elif origin is typing.Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            yield from _value_problems(value, members[0], path, sizes_only)
        else:  # Several members: check against the one the value's type picked.
            for member in members:
                kind = typing.get_origin(strip_constraints(member)) or strip_constraints(member)
                if isinstance(kind, type) and isinstance(value, kind):
                    yield from _value_problems(value, member, path, sizes_only)
                    break
    elif isinstance(value, (list, tuple)) and args:
        elems = args if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis) else None
        for i, item in enumerate(value):
            item_tp = elems[i] if elems and i < len(elems) else args[0]
            yield from _value_problems(item, item_tp, f"{path}[{i}]", sizes_only)
    elif isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            yield from _value_problems(item, args[1], f"{path}.{key}", sizes_only)
    elif isinstance(value, (list, tuple, dict)) and not sizes_only:
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
    """Every problem of the tree: field constraints, non-finite floats, the int64 range, `check_fields()`.

    One line per problem, each starting with the quoted dotted path of its field.
    Unset REQUIRED fields are not problems here (a parent may still set them).
    """
    problems: list[str] = []
    _collect(cfg, path, problems, sizes_only=False)
    return problems


def size_problems(cfg: ConfigBase, path: str = "") -> list[str]:
    """The problems of `config_problems` that `Size` constraints and the int64 range find, alone.

    Cheap, and safe on any tree: what runs before code that may allocate in proportion
    to a size (the plugins' config transforms, which may build one config per layer).
    """
    problems: list[str] = []
    _collect(cfg, path, problems, sizes_only=True)
    return problems


def _collect(cfg: ConfigBase, path: str, problems: list[str], *, sizes_only: bool) -> None:
    types_ = type(cfg).field_types()
    prefix = f"{path}." if path else ""
    for name, value in cfg.items():
        where = f"{prefix}{name}"
        problems.extend(_value_problems(value, types_[name], where, sizes_only))
        if isinstance(value, ConfigBase):
            _collect(value, where, problems, sizes_only=sizes_only)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, ConfigBase):
                    _collect(item, f"{where}[{i}]", problems, sizes_only=sizes_only)
    if not sizes_only:
        for field, problem in cfg.check_fields():
            problems.append(f"'{prefix}{field}' {problem}")


def config_warnings(cfg: ConfigBase, path: str = "") -> list[str]:
    """One line per allowed but unusual value of the tree (`Constraint.warning`), each naming its path."""
    warnings: list[str] = []
    types_ = type(cfg).field_types()
    prefix = f"{path}." if path else ""
    for name, value in cfg.items():
        where = f"{prefix}{name}"
        for constraint in split_constraints(strip_optional(types_[name]))[1]:
            text = None if value is None or value is REQUIRED else constraint.warning(value)
            if text:
                warnings.append(f"'{where}' {text}.")
        children = [(value, where)] if isinstance(value, ConfigBase) else []
        if isinstance(value, (list, tuple)):
            children = [(item, f"{where}[{i}]") for i, item in enumerate(value) if isinstance(item, ConfigBase)]
        for child, child_path in children:
            warnings.extend(config_warnings(child, child_path))
    return warnings


def strip_optional(tp: Any) -> Any:
    """`X | None` -> `X` (the annotation itself otherwise)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return members[0] if len(members) == 1 else tp
    return tp


def validate_config(cfg: ConfigBase, path: str = "") -> None:
    """Raises ConfigValidationError listing every problem `config_problems` finds."""
    problems = config_problems(cfg, path)
    if problems:
        raise ConfigValidationError(problems)
