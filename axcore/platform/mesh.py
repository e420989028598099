"""Mesh rules: which mesh and config modifiers an instance type gets.

An instance type is a string such as `cpu-8`, `gpu-h100-8`, `tpu-v5p-64`,
`neuron-trn2-16`: the platform, the device kind (`device_kind_token`; none for CPU)
and the number of devices. It is detected from JAX's devices (`detect_instance_type`)
or given with `--mesh-selector` (`mesh.instance_type`).

A `MeshRule` maps instance types (a regular expression that must fully match) to a
mesh shape (`-1` = all remaining devices), mesh axis names, logical-axis rules and
a chain of config modifiers (`axcore.experiment.config_modifiers`). Rules come from two places:
plugins register them (`axcore_register_mesh_rules`), and an experiment may list its
own under `mesh_rules:`.

Precedence (`select_mesh_rule`), the first rule that matches wins:

1. Higher `priority` first. An experiment-local rule without a `priority` comes
   before every registered rule; one with a `priority` is sorted among them.
2. At equal priority, experiment-local rules before registered ones; local rules in
   their list order, registered rules by name.
3. Two registered rules of the same priority from *different* plugins that both
   match the instance type are ambiguous: `AmbiguousMeshRuleError` names both rules
   and plugins (give one a higher priority, or pick one with `mesh.rule`). Rules of
   one plugin are ordered by name.

`mesh.rule: NAME` skips matching and uses the rule of that name (experiment-local
rules first). The built-in `default` rule (data parallelism over every device,
priority -1000) matches any instance type.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from axcore.errors import AxcoreError

# Mesh axis names with a meaning beyond the axis rules. `context`: the sequence is split over it and
# attention runs through the context-parallel kernels (axcore.kernels.attention_context, which names
# it too; docs/context_parallelism.md).
CONTEXT_AXIS = "context"

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
    # Higher is tried first; None (experiment-local rules only) = before every numbered rule.
    priority: int | None = 0

    def __post_init__(self):
        if len(self.mesh_shape) != len(self.mesh_axis_names):
            raise ValueError(f"Mesh rule {self.name}: mesh_shape and mesh_axis_names differ in length.")
        re.compile(self.instance_type)

    def matches(self, instance_type: str) -> bool:
        return re.fullmatch(self.instance_type, instance_type) is not None


class NoMeshRuleError(AxcoreError):
    """No registered mesh rule matches the instance type."""


class AmbiguousMeshRuleError(AxcoreError):
    """Two registered rules of one priority from different plugins match the instance type."""


def _priority(rule: MeshRule) -> float:
    return math.inf if rule.priority is None else rule.priority


def _registered(rules: Any) -> tuple[list[MeshRule], dict[str, str]]:
    """(rules, rule name -> plugin) of a `mesh_rules` registry or a plain sequence (one origin)."""
    if hasattr(rules, "entry"):
        entries = [rules.entry(name) for name in rules]
        return [e.value for e in entries], {e.name: e.provenance.plugin for e in entries}
    return list(rules), {}


def select_mesh_rule(rules: Any, instance_type: str, *, local: Sequence[MeshRule] = ()) -> MeshRule:
    """The mesh rule for `instance_type`, by the precedence in this module's docstring.

    Args:
        rules: the registered rules: the `mesh_rules` registry (its entries name the
            plugin of each rule, for the ambiguity check) or a sequence of rules (of
            one origin: ties go by name).
        instance_type: e.g. `gpu-h100-8`.
        local: the experiment's own rules (`mesh_rules:`), in list order.

    Raises:
        NoMeshRuleError: no rule matches.
        AmbiguousMeshRuleError: the first match ties with a registered rule of another plugin.
    """
    registered, origins = _registered(rules)
    order = [(-_priority(r), 0, i, "", r) for i, r in enumerate(local)]
    order += [(-_priority(r), 1, 0, r.name, r) for r in registered]
    order.sort(key=lambda item: item[:4])
    matching = [(item[0], item[1], item[4]) for item in order if item[4].matches(instance_type)]
    if not matching:
        names = [r.name for r in [*local, *registered]]
        raise NoMeshRuleError(
            f"No mesh rule matches instance type '{instance_type}'; rules: {', '.join(names) or 'none'}. "
            f"Install the hardware plugin for this platform, add a rule to the experiment's mesh_rules, "
            f"or pass another --mesh-selector."
        )
    priority, is_registered, winner = matching[0]
    if is_registered:
        for other_priority, _, other in matching[1:]:
            if other_priority == priority and origins.get(other.name) != origins.get(winner.name):
                raise AmbiguousMeshRuleError(
                    f"Mesh rules '{winner.name}' (plugin '{origins.get(winner.name)}') and '{other.name}' "
                    f"(plugin '{origins.get(other.name)}') both match instance type '{instance_type}' with "
                    f"priority {winner.priority}; give one a higher priority, or choose one with mesh.rule."
                )
    return winner


@dataclasses.dataclass(frozen=True)
class InstanceType:
    """The parts of an instance type string (module docstring): `gpu-h100-8` -> platform `gpu`,
    kind `h100`, count 8; `cpu-8` -> platform `cpu`, kind None, count 8. A part the string
    does not give is None (`gpu` alone: no kind, no count)."""

    platform: str
    kind: str | None
    count: int | None

    @classmethod
    def parse(cls, instance_type: str) -> InstanceType:
        platform, *rest = instance_type.split("-")
        count = int(rest.pop()) if rest and rest[-1].isdigit() else None
        return cls(platform, "-".join(rest) or None, count)


def instance_platform(instance_type: str | None) -> str | None:
    """The platform an instance type names (`gpu-h100-8` -> `gpu`), or None for None."""
    return InstanceType.parse(instance_type).platform if instance_type else None


def detect_instance_type() -> str:
    """`<platform>[-<device kind>]-<device count>` of the running JAX, e.g. `cpu-8`, `gpu-h100-8`."""
    import jax  # Deferred: only runs when a run is being laid out.

    devices = jax.devices()
    platform = devices[0].platform
    if platform == "cpu":
        return f"cpu-{len(devices)}"
    return f"{platform}-{device_kind_token(devices[0].device_kind)}-{len(devices)}"


def device_kind_token(device_kind: str) -> str:
    """The model token of a device kind, lower case: "NVIDIA H100 80GB HBM3" -> "h100", "TPU v5p" -> "v5p".

    The first word made of letters then digits (then letters); the whole kind, lower
    case, if no word is. Hardware plugins probing devices without JAX use it too, so
    probed and detected instance types agree.
    """
    kind = device_kind.lower()
    for token in re.split(r"[^a-z0-9]+", kind):
        if re.fullmatch(r"[a-z]+\d+[a-z]*", token):  # e.g. h100, a100, v5p, trn2.
            return token
    return kind


# The fallback for any instance type: data parallelism over every device.
DEFAULT_RULE = MeshRule(
    name="default",
    instance_type=".*",
    mesh_shape=(-1,),
    mesh_axis_names=("data",),
    axis_rules={},
    priority=-1000,
)
