"""Experiments: a YAML file (or a built-in name) turned into a resolved config tree.

An experiment file is merged onto the built-in default experiment:

    plugins: [my_feature>=0.1]  # enabled in this order
    my_feature: {size: 4}       # settings of plugin `my_feature`, under its own name
    model: {num_layers: 2}
    trainer: {max_steps: 50}

Resolution (docs/architecture.md, "One `axcore train`", steps 2 to 5): read YAML with a safe loader and apply
`--set` overrides; build the plugin manager; build the typed tree; run the enabled plugins' config transforms
in `plugins:` order; then the first matching mesh rule fills the mesh and applies its config modifiers.
`load_experiment` does this as the explicit list of steps `_STEPS`.

Saved runs load as they ran: `Experiment.save(run_dir)` writes the resolved config under a `resolved_by`
marker, and loading it skips the transforms and the mesh rule's modifiers (`axcore.experiment.saved`).

Re-exported here: `axcore.experiment.schema` (`ExperimentConfig` and its parts), `axcore.experiment.files`
(finding and reading experiment files), `axcore.experiment.mesh` (mesh layout), `axcore.experiment.saved`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import yaml

from axcore.config import ConfigBase, dump_flat, from_dict, parse_override, raise_collected
from axcore.config.serialize import flatten, format_value, nest_path, to_dict
from axcore.data.schema import BATCH_SCHEMA
from axcore.errors import ConfigError, UnknownFieldError, did_you_mean
from axcore.experiment.builtins import create_plugin_manager
from axcore.experiment.files import (
    SearchResult,
    builtin_experiments,
    merge_onto_base_run,
    read_experiment_file,
    search_plugins,
    with_plugin_hint,
)
from axcore.experiment.mesh import layout_mesh, local_mesh_rules
from axcore.experiment.saved import RESOLVED_KEY, check_resolved_marker, check_resolved_plugins, resolved_marker
from axcore.experiment.schema import (
    ExperimentConfig,
    MeshConfig,
    MeshRuleConfig,
    check_experiment_config,
    default_model,
)
from axcore.experiment.validation import check_sizes, validate_experiment
from axcore.kernels import (
    KernelDecision,
    current_platform,
    op_environment,
    record_kernel_choices,
    record_kernel_decisions,
)
from axcore.module import deep_merge, functional
from axcore.placement.layout import CONFIG_TEXT_FILE, config_path
from axcore.platform.distributed import DistributedSettings, initialize_distributed
from axcore.platform.mesh import instance_platform
from axcore.platform.xla_flags import (
    apply_runtime_environment,
    apply_xla_flags,
    check_xla_flags,
    format_xla_flags,
    resolve_xla_flags,
)
from axcore.plugin.loading import AxcorePluginManager, PluginRequest, probe_instance_type
from axcore.registry import Registries

__all__ = [
    "RESOLVED_KEY",
    "Experiment",
    "ExperimentConfig",
    "MeshConfig",
    "MeshRuleConfig",
    "SearchResult",
    "builtin_experiments",
    "check_experiment_config",
    "default_model",
    "layout_mesh",
    "load_experiment",
    "local_mesh_rules",
    "read_experiment_file",
    "resolve_experiment_xla_flags",
    "search_plugins",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Experiment:
    """A resolved experiment."""

    config: ExperimentConfig
    plugin_manager: AxcorePluginManager
    # Each enabled plugin's validated settings (None if it takes none).
    settings: dict[str, ConfigBase | None]
    # The file or built-in name it came from.
    source: str
    # The mesh rule applied and its origin, e.g. "gpu-h100 (plugin gpu)".
    mesh_rule: str = ""
    # The config modifiers it applied, in order, e.g. ["compute_dtype(compute='bfloat16')"].
    mesh_modifiers: list[str] = dataclasses.field(default_factory=list)
    # Environment variable the resolved `xla_flags` go to (XLA_FLAGS, LIBTPU_INIT_ARGS, NEURON_CC_FLAGS, ...).
    flags_variable: str = "XLA_FLAGS"
    # The plugin manager's registries when it is made: data for the layers below (no code of this layer runs).
    registries: Registries = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.registries = self.plugin_manager.registries

    def flat(self) -> str:
        """`path: value` lines: the config, then each plugin's settings under its name, then a
        `# mesh rule: NAME (ORIGIN); modifiers: ...` line (the rule applied and what it changed)."""
        text = dump_flat(self.config, self.registries)
        for name, settings in self.settings.items():
            if settings is not None:
                for path, value in flatten(settings, self.registries):
                    text += f"{name}.{path}: {format_value(value)}\n"
        if self.flags_variable != "XLA_FLAGS":
            text += f"# xla_flags go to {self.flags_variable}\n"
        if self.mesh_rule:
            text += f"# mesh rule: {self.mesh_rule}; modifiers: {', '.join(self.mesh_modifiers) or 'none'}\n"
        return text

    def kernel_choices(self) -> dict[str, dict[str, list[str]]]:
        """Which kernel each op call of the model selects: `{op: {kernel: [site, ...]}}` (see `kernel_decisions`)."""
        return self._trace_kernels()[0]

    def kernel_decisions(self) -> list[KernelDecision]:
        """One `KernelDecision` per op call of the model: the kernel, and why the ones before it declined.

        Traces the training loss abstractly (`jax.eval_shape`, nothing is computed or
        allocated) on a batch of the input's shape, for the experiment's instance type:
        problems carry its platform (`gpu-h100-8` -> gpu, also on a CPU machine) and the
        op environment its instance type, without a mesh (a kernel that needs devices it
        cannot see may decline, as it would when compiling for them here).
        """
        return self._trace_kernels()[1]

    def _trace_kernels(self) -> tuple[dict[str, dict[str, list[str]]], list[KernelDecision]]:
        model = self.config.model.instantiate(name="model", registries=self.registries)
        shape = (self.config.input.batch_size, self.config.input.seq_len)
        batch = BATCH_SCHEMA.shapes(*shape)

        def loss(params, batch):
            return functional(model, params, (batch,), jax.random.key(0), True)[0][0]

        instance_type = self.config.mesh.instance_type
        platform = instance_platform(instance_type)
        # Another platform's kernels are chosen for it but may not run here: the references compute.
        stand_in = platform is not None and platform != current_platform()
        target = {"instance_type": instance_type, "platform": platform, "stand_in": stand_in}
        with op_environment(None, self.config.mesh.axis_rules, **target):
            params = model.abstract_parameters()  # Outside the recording: declaring kernel state selects too.
            with record_kernel_choices() as choices, record_kernel_decisions() as decisions:
                jax.eval_shape(loss, params, batch)
        return choices, decisions

    def to_dict(self) -> dict[str, Any]:
        """The resolved experiment as YAML-safe data (config plus plugin settings)."""
        data = to_dict(self.config, self.registries)
        for name, settings in self.settings.items():
            if settings is not None:
                data[name] = to_dict(settings, self.registries)
        return data

    def resolved_dict(self) -> dict[str, Any]:
        """`to_dict()` under a first key `resolved_by` (`axcore.experiment.saved`): loads back without
        running the plugins' transforms or the mesh rule's modifiers again."""
        marker = resolved_marker(self.config.plugins, self.mesh_rule, self.mesh_modifiers)
        return {RESOLVED_KEY: marker, **self.to_dict()}

    def save(self, run_dir: str | os.PathLike) -> None:
        """Writes `config.yaml` (`resolved_dict()`, which `load_experiment` reads back to exactly this
        experiment) and `config.txt` (`flat()`) into `run_dir`, creating it if needed."""
        run_dir = pathlib.Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.resolved_dict(), sort_keys=False)
        config_path(run_dir).write_text(text, "utf-8")
        (run_dir / CONFIG_TEXT_FILE).write_text(self.flat(), "utf-8")


def load_experiment(
    source: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    objects: dict[str, Any] | None = None,
    platform: str | None = None,
    apply_xla_flags: bool = False,
    distributed: DistributedSettings | None = None,
) -> Experiment:
    """Reads, overrides, transforms and lays out an experiment.

    Runs the steps of `_STEPS` in order on one `_Loading` state:

    1. `_read_source`: the file's YAML mapping and its `resolved_by` marker, checked.
    2. `_merge_onto_base_run`: with `init_from` set (file or override), the mapping
       merged onto that run's experiment (`merge_onto_base_run`; not for a resolved
       config); a `plugins=[...]` override then adds to the base run's plugins.
    3. `_choose_plugins`: the `plugins:` list (a `plugins=[...]` override replaces it);
       a resolved config must keep the plugins whose transforms ran.
    4. `_find_instance_type`: the `mesh.instance_type` the file or overrides select,
       else (or with `apply_xla_flags`) this machine's, probed WITHOUT starting JAX's
       backend, so that XLA flags can still take effect.
    5. `_join_job_if_type_unknown`: with no instance type known, join the job now:
       the next step asks JAX's backend for the platform, and a job must be joined
       before the backend starts.
    6. `_build_plugin_manager`: built-ins, the listed plugins, the platform's plugin.
    7. `_build_config`: the typed tree, plugin settings and overrides; every bad key
       of all three is reported in one error.
    8. `_transform_config`: size checks, then the plugins' config transforms in
       `plugins:` order (not for a resolved config).
    9. `_apply_flags_and_join_job`: with the instance type known, resolve, check (a probe
       process, `check_xla_flags`) and set XLA flags and the plugins' runtime environment
       (`axcore_runtime_environment`), then join the job (flags first: the peer watch
       started after joining starts the backend, which reads the flags and the
       environment only when it starts).
    10. `_lay_out_mesh`: the mesh rule and its modifiers (a resolved config keeps its own).
    11. `_list_late_flags`: with the instance type known only now (detected from the
       started backend), resolve the flags for the record; applying them warns.
    12. `_validate`: the whole experiment against the registries.

    Args:
        source: a YAML file path or a registered experiment name (built-in or shipped
            by a plugin, see `read_experiment_file`); None = "default".
        overrides: `PATH=VALUE` strings (YAML-typed values), applied after the file;
            paths may start with a plugin name to set that plugin's settings, and
            `plugins=[...]` replaces the list.
        objects: plugin objects by name, registered directly (tests, notebooks); their
            experiments can be loaded by name.
        platform: hardware platform whose plugin is autoloaded; None = the platform of
            the selected `mesh.instance_type` (its prefix: `gpu-h100-8` -> gpu), so a GPU
            experiment resolves on a CPU machine, else this machine's (probed without
            starting JAX where a plugin can tell, see `axcore.platform.xla_flags`).
        apply_xla_flags: set the resolved `xla_flags` in the XLA_FLAGS environment
            variable before JAX's backend starts (what `axcore train` does). Applied
            only when the instance type is this machine's platform and was known
            before the backend started; otherwise a warning names what was not applied.
        distributed: join this multi-process job (`axcore.platform.distributed`) right after the
            XLA flags are set and before JAX's backend starts (devices are counted over
            every process).

    Raises:
        AxcoreError subclasses naming the offending file, key, path or plugin.
    """
    state = _Loading(source, tuple(overrides), objects, platform, apply_xla_flags, distributed)
    for step in _STEPS:
        step(state)
    return Experiment(
        state.config, state.manager, state.settings, state.label, state.mesh_rule, state.mesh_modifiers,
        state.flags_variable,
    )


@dataclasses.dataclass
class _Loading:
    """What `load_experiment` knows so far: its arguments, then what each step of `_STEPS` fills in."""

    # -- load_experiment's arguments (see its docstring).
    source: str | os.PathLike | None
    overrides: tuple[str, ...]
    objects: dict[str, Any] | None
    # The hardware platform whose plugin is autoloaded; None until `_build_plugin_manager` picks one.
    platform: str | None
    apply_xla_flags: bool
    distributed: DistributedSettings | None
    # -- filled in by the steps, in order.
    # The file's top-level mapping (`_build_config` takes the plugins' settings out of it).
    raw: dict = dataclasses.field(default_factory=dict)
    # What error messages call the source: a path, or "<built-in experiment NAME>".
    label: str = ""
    # The checked `resolved_by` marker of a saved resolved config; None = resolve in full.
    resolved: dict[str, Any] | None = None
    # The overrides as (path, value) pairs.
    parsed: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    # The `plugins:` entries (names with optional version specifiers).
    plugins: list = dataclasses.field(default_factory=list)
    # This machine's instance type, probed before JAX started; None = not asked, or no plugin could tell.
    probed: str | None = None
    # The instance type known before the backend starts (selected, else probed); None = detected later.
    known_type: str | None = None
    # The plugin manager of the built-ins, the listed plugins and the platform's plugin.
    manager: AxcorePluginManager | None = None
    # The typed tree: overrides applied, then transformed, laid out and given its XLA flags.
    config: ExperimentConfig | None = None
    # Each enabled plugin's validated settings (None if it takes none).
    settings: dict[str, ConfigBase | None] = dataclasses.field(default_factory=dict)
    # The mesh rule applied and its origin, and the config modifiers it ran (`Experiment`'s fields).
    mesh_rule: str = ""
    mesh_modifiers: list[str] = dataclasses.field(default_factory=list)
    # Environment variable the resolved `xla_flags` go to.
    flags_variable: str = "XLA_FLAGS"


def _read_source(s: _Loading) -> None:
    s.raw, s.label = read_experiment_file(s.source, objects=s.objects)
    s.resolved = check_resolved_marker(s.raw.pop(RESOLVED_KEY, None), s.label)


def _merge_onto_base_run(s: _Loading) -> None:
    s.parsed = [parse_override(o) for o in s.overrides]
    base = s.raw.get("init_from")
    for path, value in s.parsed:
        base = value if path == "init_from" else base
    if base is not None and s.resolved is None:  # A saved run was merged when it was resolved.
        if not isinstance(base, str):
            raise ConfigError(f"{s.label}: init_from must be a run directory (a string), got {base!r}.")
        for path, value in s.parsed:  # A plugins=[...] override adds to the base run's plugins, as the file's do.
            if path == "plugins":
                s.raw["plugins"] = value
        s.parsed = [(path, value) for path, value in s.parsed if path != "plugins"]
        s.raw = merge_onto_base_run(s.raw, base, s.label, drop=(RESOLVED_KEY,))


def _choose_plugins(s: _Loading) -> None:
    for path, value in s.parsed:
        if path == "plugins":
            s.raw["plugins"] = value
    s.plugins = s.raw.get("plugins") or []
    if not isinstance(s.plugins, list):
        raise ConfigError(f"{s.label}: 'plugins' must be a list of plugin names, got {s.plugins!r}.")
    if s.resolved is not None:
        check_resolved_plugins(s.resolved, s.plugins, s.label)


def _find_instance_type(s: _Loading) -> None:
    selected = _selected_instance_type(s.raw, s.parsed)
    # Asked before anything starts JAX's backend, so that XLA flags can still take effect.
    s.probed = probe_instance_type() if (s.apply_xla_flags or not selected) else None
    s.known_type = selected or s.probed


def _join_job_if_type_unknown(s: _Loading) -> None:
    if s.known_type is None:  # current_platform() starts the backend: the job must be joined first.
        initialize_distributed(s.distributed)


def _build_plugin_manager(s: _Loading) -> None:
    s.platform = s.platform or instance_platform(s.known_type) or current_platform()
    s.manager = create_plugin_manager(s.plugins, objects=s.objects, platform=s.platform)


def _build_config(s: _Loading) -> None:
    raw, label, manager = s.raw, s.label, s.manager
    plugin_names = [PluginRequest.parse(p).name for p in s.plugins]
    fields = ExperimentConfig().keys()
    settings_raw: dict[str, Any] = {}
    # Every bad key of the file and of the overrides is reported, in one pass (`from_dict`'s `errors`).
    errors: list[ConfigError] = []
    for key in [k for k in raw if k not in fields]:
        if key not in plugin_names:
            hint = did_you_mean(str(key), fields + plugin_names)
            errors.append(UnknownFieldError(
                f"{label}: unknown top-level key '{key}'{hint}; expected one of {', '.join(fields)} "
                f"or the name of a plugin listed in 'plugins'."
            ))
            del raw[key]
        else:
            settings_raw[key] = raw.pop(key)
    config = from_dict(raw, manager.registries, ExperimentConfig(), errors=errors)
    for path, value in s.parsed:
        head = path.split(".", 1)[0].split("[", 1)[0]
        if path == "plugins":
            continue
        if head in plugin_names:
            deep_merge(settings_raw, nest_path(path, value))
        else:
            try:
                config = from_dict(nest_path(path, value), manager.registries, config, errors=errors)
            except ConfigError as e:  # E.g. a malformed path.
                errors.append(e)
    s.settings = manager.settings(settings_raw, errors=errors)  # Every bad key of plugins' settings too.
    raise_collected([with_plugin_hint(e, plugin_names, s.objects) for e in errors])
    s.config = config


def _transform_config(s: _Loading) -> None:
    # Before the transforms: they may build in proportion to a size (one config per layer).
    check_sizes(s.config, s.settings)
    if s.resolved is None:
        s.config = s.manager.transform_config(s.config, s.settings)
    elif s.config.mesh.instance_type is None:
        raise ConfigError(f"{s.label}: a resolved config (it has '{RESOLVED_KEY}') must keep its mesh.instance_type.")
    if not isinstance(s.config, ExperimentConfig):
        raise ConfigError("A plugin's config transform replaced the experiment root; transform its parts only.")


def _apply_flags_and_join_job(s: _Loading) -> None:
    if s.known_type is None:
        return
    if s.resolved is None:
        s.config = resolve_experiment_xla_flags(s.config, s.manager, s.known_type)
    s.flags_variable = s.manager.flags_environment(s.known_type)
    check_xla_flags(s.config.xla_flags, s.flags_variable)  # Before they are set: XLA aborts on a bad one.
    environment = s.manager.runtime_environment(s.known_type)  # Asked always: a conflict is an error either way.
    if s.apply_xla_flags:
        _apply_before_backend(s.config.xla_flags, environment, s.known_type, s.probed, s.flags_variable)
    initialize_distributed(s.distributed)


def _lay_out_mesh(s: _Loading) -> None:
    if s.resolved is None:
        s.config, s.mesh_rule, s.mesh_modifiers = layout_mesh(s.config, s.manager)
    else:  # Laid out when it ran: the rule's modifiers are not applied twice.
        s.mesh_rule, s.mesh_modifiers = s.resolved["mesh_rule"], list(s.resolved["mesh_modifiers"])


def _list_late_flags(s: _Loading) -> None:
    if s.known_type is not None:
        return
    # Known only now that the backend has started: listed, too late to apply.
    instance_type = s.config.mesh.instance_type
    s.config = resolve_experiment_xla_flags(s.config, s.manager, instance_type)
    s.flags_variable = s.manager.flags_environment(instance_type)
    check_xla_flags(s.config.xla_flags, s.flags_variable)
    if s.apply_xla_flags:
        _apply_before_backend(s.config.xla_flags, {}, instance_type, None, s.flags_variable)


def _validate(s: _Loading) -> None:
    config, manager = s.config, s.manager
    validate_experiment(config, s.settings, manager.registries, lambda: check_experiment_config(config, manager))


# load_experiment's steps, in order (its docstring says why this order).
_STEPS = (
    _read_source,
    _merge_onto_base_run,
    _choose_plugins,
    _find_instance_type,
    _join_job_if_type_unknown,
    _build_plugin_manager,
    _build_config,
    _transform_config,
    _apply_flags_and_join_job,
    _lay_out_mesh,
    _list_late_flags,
    _validate,
)


def _selected_instance_type(raw: Mapping[str, Any], parsed: Sequence[tuple[str, Any]]) -> str | None:
    """The `mesh.instance_type` an experiment file or override names (e.g. gpu-h100-8), or None."""
    selected = (raw.get("mesh") or {}).get("instance_type") if isinstance(raw.get("mesh"), dict) else None
    for path, value in parsed:
        if path == "mesh.instance_type":
            selected = value
        elif path == "mesh" and isinstance(value, dict) and "instance_type" in value:
            selected = value["instance_type"]
    return selected if isinstance(selected, str) and selected else None


def resolve_experiment_xla_flags(
    config: ExperimentConfig, manager: AxcorePluginManager, instance_type: str
) -> ExperimentConfig:
    """A copy of `config` whose `xla_flags` are the plugins' for `instance_type` updated by its own."""
    new = config.clone()
    new.xla_flags = resolve_xla_flags(manager.xla_flags(instance_type), config.xla_flags or {})
    return new


def _apply_before_backend(
    flags: Mapping[str, str] | None, environment: Mapping[str, str], instance_type: str, probed: str | None, variable: str
) -> None:
    """Sets `flags` in `variable` (XLA_FLAGS, ...) and the plugins' runtime `environment` if this machine is
    of `instance_type`'s platform and the backend has not started. Known only late (`_list_late_flags`),
    the runtime has read its environment already: only flags come from there, and they warn."""
    flags = flags or {}
    if instance_platform(probed) != instance_platform(instance_type):
        if flags:
            why = (
                f"this machine was probed as {probed}"
                if probed
                else "no plugin could tell this machine's platform before JAX started (set JAX_PLATFORMS "
                "or install the hardware plugin)"
            )
            logger.warning(
                "XLA flags for %s not applied: %s. Put them in the %s environment variable to force them: %s",
                instance_type,
                why,
                variable,
                format_xla_flags(flags, variable),
            )
        return
    added = apply_xla_flags(flags, variable=variable)
    if added:
        logger.info("%s set for %s: %s", variable, instance_type, format_xla_flags(added, variable))
    added = apply_runtime_environment(environment)
    if added:
        logger.info("Runtime environment set for %s: %s", instance_type, " ".join(f"{k}={v}" for k, v in added.items()))
