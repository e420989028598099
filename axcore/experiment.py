"""Experiments: a YAML file (or a built-in name) turned into a resolved config tree.

An experiment file is merged onto the built-in default experiment:

    plugins: [my_feature>=0.1]  # enabled in this order
    my_feature: {size: 4}       # settings of plugin `my_feature`, under its own name
    model: {num_layers: 2}
    trainer: {max_steps: 50}

Resolution (DESIGN.md, "How an experiment becomes a running program"): read YAML
with a safe loader and apply `--set` overrides; build the plugin manager; build the
typed tree; run the enabled plugins' config transforms in `plugins:` order; then
the first matching mesh rule fills the mesh and applies its config modifiers.

Saved runs load as they ran. `Experiment.save(run_dir)` (what the trainer calls)
writes `config.txt`, the flat dump (`Experiment.flat()`), and `config.yaml`, the
resolved experiment (`Experiment.to_dict()`) under a first top-level key
`resolved_by` that records what already happened to it:

    resolved_by:
      axcore: 0.1.0                          # the version that resolved it
      plugins: [rope, swiglu]                # plugins whose config transforms ran, in order
      mesh_rule: default (plugin axcore.mesh)  # the mesh rule applied ...
      mesh_modifiers: []                     # ... and the config modifiers it ran
    plugins: [rope, swiglu]
    rope: {theta: 10000.0}
    model: ...

Loading a file with `resolved_by` enables its plugins as usual (their components,
kernels, settings and hooks) but runs neither their config transforms nor the mesh
rule's modifiers, nor resolves `xla_flags` again: the config is taken as it is, so
a transform that is not idempotent (one that doubles a value, say) is never applied
twice, and `axcore config RUN_DIR/config.yaml` prints the run's `config.txt`.
`--set` overrides still apply (e.g. `trainer.max_steps` to train on). Its `plugins:`
must still name the plugins of `resolved_by.plugins`, in that order: a transform
that ran cannot be undone, nor a new one run on a resolved config (change the
original experiment instead). A file without `resolved_by` (an experiment written
by hand, or a run directory of an older axcore) is resolved in full.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import jax
import yaml

from axcore import __version__

from axcore.config import REQUIRED, ConfigBase, InstantiableConfig, Matches, dump_flat, from_dict, parse_override, raise_collected
from axcore.config.safe_yaml import read_file as read_yaml_file
from axcore.config.serialize import flatten, format_value, nest_path, safe_load, to_dict
from axcore.data import ByteTokenizer, InputConfig, Tokenizer
from axcore.data.schema import BATCH_SCHEMA
from axcore.config_modifiers import apply_modifier, build_modifier, describe_modifier
from axcore.errors import (
    AxcoreError,
    ConfigError,
    MissingRequiredError,
    PluginError,
    UnknownComponentError,
    UnknownFieldError,
    did_you_mean,
)
from axcore.experiments import experiment_text
from axcore.kernels import KernelDecision, current_platform, op_environment, record_kernel_choices, record_kernel_decisions
from axcore.layers import CausalLM
from axcore.mesh import MeshRule, detect_instance_type, select_mesh_rule
from axcore.module import functional
from axcore.plugins import (
    BUILTIN_DISTRIBUTION,
    AxcorePluginManager,
    PluginRequest,
    autoload_disabled,
    create_plugin_manager,
    installed_entry_points,
    probe_instance_type,
)
from axcore.registry import Registration, Registry
from axcore.trainer.config import TrainerConfig, check_trainer_config
from axcore.trainer.learner import check_component
from axcore.distributed import DistributedSettings, initialize_distributed
from axcore.validation import check_sizes, validate_experiment
from axcore.xla_flags import apply_xla_flags, format_xla_flags, resolve_xla_flags

logger = logging.getLogger(__name__)

# Top-level key of a saved resolved experiment (`Experiment.save`): what already ran (module docstring).
RESOLVED_KEY = "resolved_by"


class MeshConfig(ConfigBase):
    """Device mesh; unset fields are filled from the matching mesh rule."""

    # Instance type matched against mesh rules; None = detected (e.g. cpu-1, gpu-h100-8).
    instance_type: str | None = None
    # Mesh rule to use by name; None = the first rule matching the instance type.
    rule: str | None = None
    # Mesh shape (-1 = all remaining devices); None = the rule's.
    mesh_shape: tuple[int, ...] | None = None
    # Mesh axis names; None = the rule's.
    mesh_axis_names: tuple[str, ...] | None = None
    # Logical axis -> mesh axis (or list of axes, or null); None = the rule's.
    axis_rules: dict[str, Any] | None = None

    def check_fields(self) -> list[tuple[str, str]]:
        shape = self.mesh_shape
        if shape is not None and (shape.count(-1) > 1 or any(d < 1 and d != -1 for d in shape)):
            return [("mesh_shape", f"needs positive sizes and at most one -1 (all remaining devices), got {list(shape)}.")]
        return []


class MeshRuleConfig(ConfigBase):
    """An experiment's own mesh rule (a `mesh_rules:` entry); precedence in `axcore.mesh`."""

    # Rule name (shown as mesh.rule; mesh.rule may name it).
    name: str = REQUIRED
    # Regular expression that must fully match the instance type, e.g. 'gpu-h100-.*'.
    instance_type: str = REQUIRED
    # Mesh shape (-1 = all remaining devices).
    mesh_shape: tuple[int, ...] = (-1,)
    # One name per mesh dimension.
    mesh_axis_names: tuple[str, ...] = ("data",)
    # Logical axis -> mesh axis (or list of axes, or null).
    axis_rules: dict[str, Any] = {}
    # Config modifiers applied in order: {type: NAME, ...arguments} (axcore.config_modifiers).
    modifiers: list[dict[str, Any]] = []
    # None = tried before every registered rule; a number sorts it among them (first on ties).
    priority: int | None = None


def default_model() -> InstantiableConfig:
    """A 4-layer, d=256 byte-level decoder."""
    cfg = CausalLM.default_config().set(vocab_size=256, dim=256, num_layers=4)
    cfg.position_embedding.max_len = 512
    cfg.decoder.layer.self_attention.num_heads = 4
    cfg.decoder.layer.feed_forward.hidden_dim = 1024
    return cfg


class ExperimentConfig(ConfigBase):
    """Everything a training run needs."""

    # Experiment name; run directories are named after it (letters, digits, '.', '_', '-').
    name: Annotated[str, Matches(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", "1-100 letters, digits, '.', '_' or '-' (not first)")] = "default"
    # Plugins to enable, in order (names with optional version specifiers).
    plugins: list[str] = []
    # The model.
    model: InstantiableConfig = default_model()
    # Input pipeline.
    input: InputConfig = InputConfig()
    # Text <-> token ids: a registered tokenizer (bytes, or a plugin's); the end-of-run sample uses it.
    tokenizer: InstantiableConfig = ByteTokenizer.default_config()
    # Training loop.
    trainer: TrainerConfig = TrainerConfig()
    # Device mesh.
    mesh: MeshConfig = MeshConfig()
    # The experiment's own mesh rules, tried before registered ones (see axcore.mesh).
    mesh_rules: list[MeshRuleConfig] = []
    # XLA flags {name: value} (no leading --) over the plugins' for the instance type; null removes one.
    xla_flags: dict[str, Any] = {}


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

    @property
    def registries(self):
        return self.plugin_manager.registries

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
        platform = instance_type.split("-", 1)[0] if instance_type else None
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
        """`to_dict()` under a first key `resolved_by` (module docstring): loads back without
        running the plugins' transforms or the mesh rule's modifiers again."""
        plugins = [PluginRequest.parse(p).name for p in self.config.plugins]
        marker = {
            "axcore": __version__,
            "plugins": plugins,
            "mesh_rule": self.mesh_rule,
            "mesh_modifiers": list(self.mesh_modifiers),
        }
        return {RESOLVED_KEY: marker, **self.to_dict()}

    def save(self, run_dir: str | os.PathLike) -> None:
        """Writes `config.yaml` (`resolved_dict()`, which `load_experiment` reads back to exactly this
        experiment) and `config.txt` (`flat()`) into `run_dir`, creating it if needed."""
        run_dir = pathlib.Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.resolved_dict(), sort_keys=False)
        (run_dir / "config.yaml").write_text(text, "utf-8")
        (run_dir / "config.txt").write_text(self.flat(), "utf-8")


@dataclasses.dataclass
class SearchResult:
    """Registrations of one family found among built-in, given and installed plugins."""

    # Name -> registration.
    found: dict[str, Registration]
    # Plugin -> why it could not be searched (it failed to load or to register).
    broken: dict[str, str]


def _builtin_registry(family: str) -> Registry:
    """Family `family` of a manager with only the built-in plugins."""
    return create_plugin_manager().registries.family(family)


def search_plugins(
    family: str, *, objects: Mapping[str, Any] | None = None, installed: bool = True, name: str | None = None
) -> SearchResult:
    """What the built-in plugins, the plugins given as `objects` and installed plugins register in `family`.

    Searched in that order; with `name`, the search stops at the first of the three
    that provides it (so a built-in name loads no plugin). Each plugin is loaded on
    its own, with the built-ins, so plugins that could never be enabled together do
    not conflict and a broken one is reported in `broken` instead of stopping the
    search. Installed plugins are searched unless `installed` is False or
    AXCORE_DISABLE_PLUGIN_AUTOLOAD is set. Names follow the usual rule: one name from
    two places is an error naming both, unless exactly one says override=True.

    Raises:
        DuplicateComponentError: one name from two places, neither overriding the other.
    """
    builtin = _builtin_registry(family)
    merged: Registry = Registry(builtin.kind)
    for n in builtin:
        entry = builtin.entry(n)
        merged.register(n, entry.value, entry.provenance, entry.override)
    broken: dict[str, str] = {}
    objects = dict(objects or {})
    phases = [sorted(objects)]
    if installed and not autoload_disabled():
        phases.append(sorted(set(installed_entry_points()) - set(objects)))
    for plugins in phases:
        if name is not None and name in merged:
            break
        for plugin in plugins:
            try:
                registry = create_plugin_manager([plugin], objects=objects).registries.family(family)
            except PluginError as e:
                broken[plugin] = " ".join(str(e).split())
                continue
            for n in registry:
                entry = registry.entry(n)
                if entry.provenance.plugin == plugin:
                    merged.register(n, entry.value, entry.provenance, entry.override)
    return SearchResult({n: merged.entry(n) for n in merged}, broken)


def builtin_experiments() -> list[str]:
    """Names of the experiments the built-in plugins ship (axcore/experiments/*.yaml)."""
    return _builtin_registry("experiments").names()


def _looks_like_path(source: str) -> bool:
    return os.sep in source or "/" in source or source.endswith((".yaml", ".yml"))


def read_experiment_file(
    source: str | os.PathLike | None, *, objects: Mapping[str, Any] | None = None
) -> tuple[dict, str]:
    """Raw YAML mapping of a file path or a registered experiment name (None = "default").

    A name is looked up among the built-in plugins, then `objects`, then installed
    plugins (see `search_plugins`; a path-like name searches no installed plugin);
    the experiment's own `plugins:` list decides which plugins it enables.
    """
    source = "default" if source is None else os.fspath(source)
    if os.path.isfile(source):
        text, label = read_yaml_file(source), source  # Bytes, at most the YAML size limit.
    else:
        search = search_plugins("experiments", objects=objects, installed=not _looks_like_path(source), name=source)
        entry = search.found.get(source)
        if entry is None:
            raise ConfigError(_unknown_experiment(source, search))
        value = entry.value
        text = value.read_bytes() if callable(getattr(value, "read_bytes", None)) else experiment_text(value)
        if entry.provenance.distribution == BUILTIN_DISTRIBUTION:
            label = f"<built-in experiment {source}>"
        else:
            label = f"<experiment {source} of {entry.provenance}>"
    data = safe_load(text, label=label)  # Hardened: one-line ConfigError naming `label`.
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: an experiment file must be a mapping, got {type(data).__name__}.")
    return data, label


def _unknown_experiment(source: str, search: SearchResult) -> str:
    available = [
        name if entry.provenance.distribution == BUILTIN_DISTRIBUTION else f"{name} (plugin {entry.provenance.plugin})"
        for name, entry in sorted(search.found.items())
    ]
    message = (
        f"Experiment '{source}' is neither a file nor a built-in experiment{did_you_mean(source, search.found)}; "
        f"available: {', '.join(available) or 'none'}. Check the path, or install the plugin that ships it."
    )
    if search.broken:
        message += f" Plugins that could not be searched: {', '.join(sorted(search.broken))} (see 'axcore plugins')."
    return message


def _platform() -> str:
    platform = jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def _selected_instance_type(raw: Mapping[str, Any], parsed: Sequence[tuple[str, Any]]) -> str | None:
    """The `mesh.instance_type` an experiment file or override names (e.g. gpu-h100-8), or None."""
    selected = (raw.get("mesh") or {}).get("instance_type") if isinstance(raw.get("mesh"), dict) else None
    for path, value in parsed:
        if path == "mesh.instance_type":
            selected = value
        elif path == "mesh" and isinstance(value, dict) and "instance_type" in value:
            selected = value["instance_type"]
    return selected if isinstance(selected, str) and selected else None


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
            starting JAX where a plugin can tell, see `axcore.xla_flags`).
        apply_xla_flags: set the resolved `xla_flags` in the XLA_FLAGS environment
            variable before JAX's backend starts (what `axcore train` does). Applied
            only when the instance type is this machine's platform and was known
            before the backend started; otherwise a warning names what was not applied.
        distributed: join this multi-process job (`axcore.distributed`) right after the
            XLA flags are set and before JAX's backend starts (devices are counted over
            every process).

    Raises:
        AxcoreError subclasses naming the offending file, key, path or plugin.
    """
    raw, label = read_experiment_file(source, objects=objects)
    resolved = _resolved_marker(raw.pop(RESOLVED_KEY, None), label)
    parsed = [parse_override(o) for o in overrides]
    for path, value in parsed:
        if path == "plugins":
            raw["plugins"] = value
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list):
        raise ConfigError(f"{label}: 'plugins' must be a list of plugin names, got {plugins!r}.")
    if resolved is not None:
        _check_resolved_plugins(resolved, plugins, label)
    selected = _selected_instance_type(raw, parsed)
    # Asked before anything starts JAX's backend, so that XLA flags can still take effect.
    probed = probe_instance_type() if (apply_xla_flags or not selected) else None
    known_type = selected or probed
    if known_type is None:  # _platform() starts the backend: the job must be joined first.
        initialize_distributed(distributed)
    platform = platform or (known_type.split("-", 1)[0] if known_type else _platform())
    manager = create_plugin_manager(plugins, objects=objects, platform=platform)
    plugin_names = [PluginRequest.parse(p).name for p in plugins]
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
    for path, value in parsed:
        head = path.split(".", 1)[0].split("[", 1)[0]
        if path == "plugins":
            continue
        if head in plugin_names:
            _deep_merge(settings_raw, nest_path(path, value))
        else:
            try:
                config = from_dict(nest_path(path, value), manager.registries, config, errors=errors)
            except ConfigError as e:  # E.g. a malformed path.
                errors.append(e)
    settings = manager.settings(settings_raw, errors=errors)  # Every bad key of plugins' settings too.
    raise_collected(errors)
    # Before the transforms: they may build in proportion to a size (one config per layer).
    check_sizes(config, settings)
    if resolved is None:
        config = manager.transform_config(config, settings)
    elif config.mesh.instance_type is None:
        raise ConfigError(f"{label}: a resolved config (it has '{RESOLVED_KEY}') must keep its mesh.instance_type.")
    if not isinstance(config, ExperimentConfig):
        raise ConfigError("A plugin's config transform replaced the experiment root; transform its parts only.")
    if known_type is not None:
        if resolved is None:
            config = resolve_experiment_xla_flags(config, manager, known_type)
        flags_variable = manager.flags_environment(known_type)
        if apply_xla_flags:
            _apply_flags(config.xla_flags, known_type, probed, flags_variable)
        initialize_distributed(distributed)
    if resolved is None:
        config, mesh_rule, mesh_modifiers = layout_mesh(config, manager)
    else:  # Laid out when it ran: the rule's modifiers are not applied twice.
        mesh_rule, mesh_modifiers = resolved["mesh_rule"], list(resolved["mesh_modifiers"])
    if known_type is None:  # Known only now that the backend has started: listed, too late to apply.
        config = resolve_experiment_xla_flags(config, manager, config.mesh.instance_type)
        flags_variable = manager.flags_environment(config.mesh.instance_type)
        if apply_xla_flags:
            _apply_flags(config.xla_flags, config.mesh.instance_type, None, flags_variable)
    validate_experiment(config, settings, manager.registries, lambda: check_experiment_config(config, manager))
    return Experiment(config, manager, settings, label, mesh_rule, mesh_modifiers, flags_variable)


def _resolved_marker(marker: Any, label: str) -> dict[str, Any] | None:
    """The checked `resolved_by` mapping of a saved resolved experiment, or None (none there)."""
    if marker is None:
        return None
    expected = "a mapping with keys axcore, plugins, mesh_rule and mesh_modifiers (as Experiment.save writes it)"
    if not isinstance(marker, dict):
        raise ConfigError(f"{label}: '{RESOLVED_KEY}' must be {expected}, got {marker!r}.")
    marker = {"axcore": None, "plugins": [], "mesh_rule": "", "mesh_modifiers": [], **marker}
    unknown = sorted(set(marker) - {"axcore", "plugins", "mesh_rule", "mesh_modifiers"})
    lists_of_str = all(
        isinstance(marker[k], list) and all(isinstance(v, str) for v in marker[k]) for k in ("plugins", "mesh_modifiers")
    )
    if unknown or not lists_of_str or not isinstance(marker["mesh_rule"], str):
        raise ConfigError(f"{label}: '{RESOLVED_KEY}' must be {expected}, got {marker!r}.")
    if marker["axcore"] != __version__:
        logger.warning("%s was resolved by axcore %s; this is axcore %s.", label, marker["axcore"], __version__)
    return marker


def _check_resolved_plugins(resolved: Mapping[str, Any], plugins: list, label: str) -> None:
    """Raises ConfigError unless `plugins` names the plugins whose transforms already ran, in order."""
    names = [PluginRequest.parse(p, f"plugins[{i}]").name for i, p in enumerate(plugins)]
    ran = list(resolved["plugins"])
    if names != ran:
        raise ConfigError(
            f"{label} is a resolved config (its '{RESOLVED_KEY}' lists the plugins whose transforms ran: "
            f"{ran or 'none'}), but 'plugins' is {names}; a resolved config keeps its plugins. To change them, "
            f"load the original experiment, or delete '{RESOLVED_KEY}' to resolve this file again in full."
        )


def resolve_experiment_xla_flags(
    config: ExperimentConfig, manager: AxcorePluginManager, instance_type: str
) -> ExperimentConfig:
    """A copy of `config` whose `xla_flags` are the plugins' for `instance_type` updated by its own."""
    new = config.clone()
    new.xla_flags = resolve_xla_flags(manager.xla_flags(instance_type), config.xla_flags or {})
    return new


def _apply_flags(flags: Mapping[str, str], instance_type: str, probed: str | None, variable: str) -> None:
    """Sets `flags` in `variable` (XLA_FLAGS, ...) if they are for this machine and the backend has not started."""
    if not flags:
        return
    machine = probed.split("-", 1)[0] if probed else None
    if machine != instance_type.split("-", 1)[0]:
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


def check_experiment_config(config: ExperimentConfig, manager: AxcorePluginManager) -> None:
    """Checks the components the registries must know (optimizer, schedule, writers, tokenizer, backend)."""
    registries = manager.registries
    check_component(config.tokenizer, Tokenizer, "tokenizer", names=registries.tokenizers.names())
    check_trainer_config(config.trainer, registries)


def _deep_merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def resolve_mesh(config: ExperimentConfig, manager: AxcorePluginManager) -> ExperimentConfig:
    """Fills `config.mesh` from the selected mesh rule and applies its config modifiers (see `layout_mesh`)."""
    return layout_mesh(config, manager)[0]


# Mesh fields an experiment may set itself; set ones win over the rule and its modifiers.
_MESH_FIELDS = ("mesh_shape", "mesh_axis_names", "axis_rules")


def layout_mesh(config: ExperimentConfig, manager: AxcorePluginManager) -> tuple[ExperimentConfig, str, list[str]]:
    """The config laid out by its mesh rule, the rule (with its origin) and the modifiers it applied.

    The rule is `mesh.rule` if set, else the first of the experiment's `mesh_rules:`
    and the registered rules that matches `mesh.instance_type` (detected if unset),
    by the precedence in `axcore.mesh`. Unset `mesh.*` fields are filled from the
    rule, then its modifiers run in order; mesh fields the experiment set win over
    both.

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
