"""Declared field ranges (`axcore.config.constraints`): what a plugin author writes, and what it reports."""

from __future__ import annotations

import math
from typing import Annotated, Any

import pytest

from axcore.config import (
    AllowNonFinite,
    ConfigBase,
    ConfigValidationError,
    Matches,
    MaxLength,
    NonNegative,
    Positive,
    Probability,
    Range,
    config_problems,
    validate_config,
)


class Inner(ConfigBase):
    # Heads.
    heads: Annotated[int, Positive] = 4
    # Model dimension.
    dim: Annotated[int, Positive] = 64

    def check_fields(self):
        if self.heads > 0 and self.dim % self.heads:
            return [("heads", f"must divide dim ({self.dim}), got {self.heads}.")]
        return []


class Outer(ConfigBase):
    # A probability.
    rate: Annotated[float, Probability] = 0.1
    # Optional positive.
    window: Annotated[int, Positive] | None = None
    # Sizes, each at least 0.
    sizes: tuple[Annotated[int, NonNegative], ...] = (1, 2)
    # Untyped extras: still finite.
    extras: dict[str, Any] = {}
    # May be infinite.
    limit: Annotated[float, AllowNonFinite] = math.inf
    # A name.
    name: Annotated[str, Matches(r"[a-z]+", "lower-case letters"), MaxLength(8)] = "ok"
    # Between 1 and 10.
    level: Annotated[int, Range(ge=1, le=10)] = 5
    # A nested node.
    inner: Inner = Inner()
    # Nodes in a list.
    more: list[Inner] = []


def test_valid_defaults_have_no_problems():
    assert config_problems(Outer()) == []


def test_every_problem_is_listed_with_its_path():
    cfg = Outer(rate=1.0, window=0, sizes=(3, -1), extras={"a": [1.0, math.nan]}, name="Bad!", level=11)
    cfg.inner.dim = 0
    cfg.more = [Inner(heads=3)]
    assert config_problems(cfg, "root") == [
        "'root.rate' must be >= 0 and < 1, got 1.0.",
        "'root.window' must be > 0, got 0.",
        "'root.sizes[1]' must be >= 0, got -1.",
        "'root.extras.a[1]' must be a finite number, got nan.",
        "'root.name' must be lower-case letters, got 'Bad!'.",
        "'root.level' must be >= 1 and <= 10, got 11.",
        "'root.inner.dim' must be > 0, got 0.",
        "'root.more[0].heads' must divide dim (64), got 3.",
    ]


def test_nan_is_refused_unless_allowed():
    assert config_problems(Outer(rate=math.nan)) == ["'rate' must be a finite number, got nan."]
    assert config_problems(Outer(limit=math.nan)) == []


def test_max_length():
    assert config_problems(Outer(name="abcdefghij")) == ["'name' must have at most 8 items (characters), has 10, got 'abcdefghij'."]


def test_assignment_checks_types_not_ranges_and_validate_raises_all():
    cfg = Outer(rate=2.0)  # Accepted on assignment: ranges are checked in one pass.
    cfg.window = -3
    with pytest.raises(ConfigValidationError) as raised:
        validate_config(cfg)
    assert raised.value.problems == ["'rate' must be >= 0 and < 1, got 2.0.", "'window' must be > 0, got -3."]
    assert str(raised.value) == "'rate' must be >= 0 and < 1, got 2.0. (and 1 more problem(s))"
    with pytest.raises(TypeError):
        Outer(window="three")
