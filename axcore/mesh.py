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
from axcore.markers import hookimpl

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


def detect_instance_type() -> str:
    """`<platform>[-<device kind>]-<device count>` of the running JAX, e.g. `cpu-8`, `gpu-h100-8`."""
    import jax  # Deferred: only runs when a run is being laid out.

    devices = jax.devices()
    platform = devices[0].platform
    if platform == "cpu":
        return f"cpu-{len(devices)}"
    kind = devices[0].device_kind.lower()
    for token in re.split(r"[^a-z0-9]+", kind):
        if re.fullmatch(r"[a-z]+\d+[a-z]*", token):  # e.g. h100, a100, v5p, trn2.
            kind = token
            break
    return f"{platform}-{kind}-{len(devices)}"


# The fallback for any instance type: data parallelism over every device.
DEFAULT_RULE = MeshRule(
    name="default",
    instance_type=".*",
    mesh_shape=(-1,),
    mesh_axis_names=("data",),
    axis_rules={},
    priority=-1000,
)


@hookimpl
def axcore_register_mesh_rules(register):
    register(DEFAULT_RULE)
