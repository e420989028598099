"""Mesh layout of an experiment: its mesh rule selected, `mesh.*` filled, the rule's config modifiers run.

`layout_mesh` is step 5 of docs/architecture.md's "One `axcore train`" (docs/scaling.md,
"Mesh rules and config modifiers"): the experiment's own `mesh_rules:` (checked by
`local_mesh_rules`) and the registered rules are matched against `mesh.instance_type` by the precedence
in `axcore.platform.mesh`; mesh fields the experiment set itself win over the rule and its
modifiers.

Layer: experiment (imports config modifiers, mesh, the schema; never the loader).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from axcore.errors import AxcoreError, ConfigError, MissingRequiredError, UnknownComponentError, did_you_mean
from axcore.experiment.config_modifiers import apply_modifier, build_modifier, describe_modifier
from axcore.experiment.schema import ExperimentConfig
from axcore.platform.mesh import MeshRule, detect_instance_type, select_mesh_rule

if TYPE_CHECKING:
    from axcore.plugin.loading import AxcorePluginManager

# Mesh fields an experiment may set itself; set ones win over the rule and its modifiers.
_MESH_FIELDS = ("mesh_shape", "mesh_axis_names", "axis_rules")


def layout_mesh(config: ExperimentConfig, manager: AxcorePluginManager) -> tuple[ExperimentConfig, str, list[str]]:
    """The config laid out by its mesh rule, the rule (with its origin) and the modifiers it applied.

    The rule is `mesh.rule` if set, else the first of the experiment's `mesh_rules:`
    and the registered rules that matches `mesh.instance_type` (detected if unset),
    by the precedence in `axcore.platform.mesh`. Unset `mesh.*` fields are filled from the
    rule, then its modifiers run in order; mesh fields the experiment set win over
    both. `config` itself is not changed.

    Returns:
        `(config, "RULE (ORIGIN)", ["modifier(args)", ...])`, e.g. origin "plugin gpu"
        or "experiment mesh_rules[0]".

    Raises:
        AxcoreError subclasses naming the offending `mesh_rules[i]` entry, rule or modifier.
    """
    config = config.clone()
    mesh = config.mesh
    registries = manager.registries
    registered = registries.mesh_rules
    local = local_mesh_rules(config, manager)
    if mesh.instance_type is None:
        mesh.instance_type = detect_instance_type()
    if mesh.rule is None:
        rule = select_mesh_rule(registered, mesh.instance_type, local=local)
    else:
        rule = next((r for r in local if r.name == mesh.rule), None)
        if rule is None and mesh.rule not in registered:
            names = [r.name for r in local] + registered.names()
            raise UnknownComponentError(
                f"'mesh.rule' names no mesh rule '{mesh.rule}'{did_you_mean(mesh.rule, names)}; rules: {', '.join(names)}."
            )
        rule = rule or registered[mesh.rule]
    index = next((i for i, r in enumerate(local) if r is rule), None)
    origin = f"experiment mesh_rules[{index}]" if index is not None else f"plugin {registered.entry(rule.name).provenance.plugin}"
    explicit = {name: getattr(mesh, name) for name in _MESH_FIELDS if getattr(mesh, name) is not None}
    mesh.rule = rule.name
    mesh.mesh_shape = tuple(rule.mesh_shape)
    mesh.mesh_axis_names = tuple(rule.mesh_axis_names)
    mesh.axis_rules = {k: (list(v) if isinstance(v, tuple) else v) for k, v in rule.axis_rules.items()}
    applied = []
    for modifier in rule.config_modifiers:
        name = describe_modifier(modifier)
        try:
            new = apply_modifier(modifier, config, registries)
        except AxcoreError as e:
            raise type(e)(f"Mesh rule '{rule.name}' ({origin}): {e}") from None
        if not isinstance(new, ExperimentConfig):
            raise ConfigError(
                f"Config modifier {name} of mesh rule '{rule.name}' ({origin}) returned {type(new).__name__}; "
                f"modifiers must return the new config."
            )
        config = new
        applied.append(name)
    config.mesh.set(**explicit)
    shape, axes = config.mesh.mesh_shape, config.mesh.mesh_axis_names
    if len(shape) != len(axes):
        raise ConfigError(
            f"mesh.mesh_shape {list(shape)} and mesh.mesh_axis_names {list(axes)} differ in length (mesh rule "
            f"'{rule.name}', {origin}; the experiment set {', '.join(f'mesh.{n}' for n in explicit) or 'neither'}); "
            f"set both."
        )
    return config, f"{rule.name} ({origin})", applied


def local_mesh_rules(config: ExperimentConfig, manager: AxcorePluginManager) -> list[MeshRule]:
    """The experiment's `mesh_rules:` as `MeshRule`s, each checked; errors name `mesh_rules[i]...`."""
    registries = manager.registries
    rules: list[MeshRule] = []
    for i, entry in enumerate(config.mesh_rules):
        where = f"mesh_rules[{i}]"
        missing = entry.missing_required()
        if missing:
            raise MissingRequiredError(
                f"'{where}' needs {' and '.join(missing)}: a name, and a regular expression over instance types."
            )
        if entry.name in [r.name for r in rules]:
            raise ConfigError(f"'{where}.name': another entry of mesh_rules is named '{entry.name}'; rename one.")
        if entry.name in registries.mesh_rules:
            raise ConfigError(
                f"'{where}.name': '{entry.name}' is a mesh rule of "
                f"{registries.mesh_rules.entry(entry.name).provenance} already; choose another name."
            )
        try:
            re.compile(entry.instance_type)
        except re.error as e:
            raise ConfigError(f"'{where}.instance_type': '{entry.instance_type}' is not a regular expression: {e}.") from None
        shape, axes = tuple(entry.mesh_shape), tuple(entry.mesh_axis_names)
        if len(shape) != len(axes) or shape.count(-1) > 1 or any(d < 1 and d != -1 for d in shape):
            raise ConfigError(
                f"'{where}': mesh_shape {list(shape)} needs positive sizes (one -1 at most), one per name of "
                f"mesh_axis_names {list(axes)}."
            )
        modifiers = tuple(
            build_modifier(spec, registries, f"{where}.modifiers[{j}]") for j, spec in enumerate(entry.modifiers)
        )
        rules.append(
            MeshRule(entry.name, entry.instance_type, shape, axes, dict(entry.axis_rules), modifiers, entry.priority)
        )
    return rules
