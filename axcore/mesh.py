"""Mesh rules: which mesh and config modifiers an instance type gets.

An instance type is a string such as `cpu-8`, `gpu-h100-8`, `tpu-v5p-64`. Hardware
plugins register `MeshRule`s; the first rule (by descending priority, then name)
whose pattern fully matches the instance type applies.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from axcore.errors import AxcoreError

# A config modifier takes a config tree and returns a new one (never edits in place).
ConfigModifier = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class MeshRule:
    """How to lay out a run on matching instance types."""

    # Registered name.
    name: str
    # Regular expression that must fully match the instance type.
    instance_type: str
    # Mesh shape; -1 in one position means "all remaining devices".
    mesh_shape: tuple[int, ...]
    # One name per mesh dimension.
    mesh_axis_names: tuple[str, ...]
    # Logical axis name -> mesh axis name(s) or None (replicated).
    axis_rules: Mapping[str, str | tuple[str, ...] | None] = dataclasses.field(default_factory=dict)
    # Applied in order to the config after plugin transforms.
    config_modifiers: Sequence[ConfigModifier] = ()
    # Higher is tried first.
    priority: int = 0

    def __post_init__(self):
        if len(self.mesh_shape) != len(self.mesh_axis_names):
            raise ValueError(f"Mesh rule {self.name}: mesh_shape and mesh_axis_names differ in length.")
        re.compile(self.instance_type)

    def matches(self, instance_type: str) -> bool:
        return re.fullmatch(self.instance_type, instance_type) is not None


class NoMeshRuleError(AxcoreError):
    """No registered mesh rule matches the instance type."""


def select_mesh_rule(rules: Sequence[MeshRule], instance_type: str) -> MeshRule:
    """The first matching rule by (priority desc, name)."""
    for rule in sorted(rules, key=lambda r: (-r.priority, r.name)):
        if rule.matches(instance_type):
            return rule
    raise NoMeshRuleError(
        f"No mesh rule matches instance type '{instance_type}'; registered rules: "
        f"{', '.join(r.name for r in rules) or 'none'}. Install the hardware plugin for "
        f"this platform or pass a mesh selector."
    )
