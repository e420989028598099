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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import yaml

from axcore.config import ConfigBase, InstantiableConfig, dump_flat, from_dict, parse_override
from axcore.config.serialize import flatten, format_value, nest_path, safe_load, to_dict
from axcore.data import ByteTokenizer, InputConfig, Tokenizer
from axcore.errors import ConfigError, PluginError, UnknownFieldError, did_you_mean
from axcore.experiments import experiment_text
from axcore.kernels import op_environment, record_kernel_choices
from axcore.layers import CausalLM
from axcore.mesh import detect_instance_type, select_mesh_rule
from axcore.module import functional
from axcore.plugins import (
    BUILTIN_DISTRIBUTION,
    AxcorePluginManager,
    PluginRequest,
    autoload_disabled,
    create_plugin_manager,
    installed_entry_points,
)
from axcore.registry import Registration, Registry
from axcore.trainer.config import TrainerConfig, check_trainer_config
from axcore.trainer.learner import check_component


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


def default_model() -> InstantiableConfig:
    """A 4-layer, d=256 byte-level decoder."""
    cfg = CausalLM.default_config().set(vocab_size=256, dim=256, num_layers=4)
    cfg.position_embedding.max_len = 512
    cfg.decoder.layer.self_attention.num_heads = 4
    cfg.decoder.layer.feed_forward.hidden_dim = 1024
    return cfg


class ExperimentConfig(ConfigBase):
    """Everything a training run needs."""

    # Experiment name; run directories are named after it.
    name: str = "default"
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


@dataclasses.dataclass
class Experiment:
    """A resolved experiment."""

    config: ExperimentConfig
    plugin_manager: AxcorePluginManager
    # Each enabled plugin's validated settings (None if it takes none).
    settings: dict[str, ConfigBase | None]
    # The file or built-in name it came from.
    source: str

    @property
    def registries(self):
        return self.plugin_manager.registries

    def flat(self) -> str:
        """`path: value` lines: the config, then each plugin's settings under its name."""
        text = dump_flat(self.config, self.registries)
        for name, settings in self.settings.items():
            if settings is not None:
                for path, value in flatten(settings, self.registries):
                    text += f"{name}.{path}: {format_value(value)}\n"
        return text

    def kernel_choices(self) -> dict[str, dict[str, list[str]]]:
        """Which kernel each op call of the model selects here: `{op: {kernel: [site, ...]}}`.

        Traces the training loss abstractly (`jax.eval_shape`, nothing is computed or
        allocated) on a batch of the input's shape, inside the run's op environment
        without a mesh (a kernel that needs devices it cannot see declines, as it would
        when compiling for them here).
        """
        model = self.config.model.instantiate(name="model", registries=self.registries)
        shape = (self.config.input.batch_size, self.config.input.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("input_ids", "target_labels")}

        def loss(params, batch):
            return functional(model, params, (batch,), jax.random.key(0), True)[0][0]

        params = model.abstract_parameters()  # Outside the recording: declaring kernel state selects too.
        with op_environment(None, self.config.mesh.axis_rules), record_kernel_choices() as choices:
            jax.eval_shape(loss, params, batch)
        return choices

    def to_dict(self) -> dict[str, Any]:
        """The resolved experiment as YAML-safe data (config plus plugin settings)."""
        data = to_dict(self.config, self.registries)
        for name, settings in self.settings.items():
            if settings is not None:
                data[name] = to_dict(settings, self.registries)
        return data


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
        with open(source, encoding="utf-8") as f:
            text, label = f.read(), source
    else:
        search = search_plugins("experiments", objects=objects, installed=not _looks_like_path(source), name=source)
        entry = search.found.get(source)
        if entry is None:
            raise ConfigError(_unknown_experiment(source, search))
        text = experiment_text(entry.value)
        if entry.provenance.distribution == BUILTIN_DISTRIBUTION:
            label = f"<built-in experiment {source}>"
        else:
            label = f"<experiment {source} of {entry.provenance}>"
    try:
        data = safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{label}: invalid YAML: {' '.join(str(e).split())}") from None
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
            experiment resolves on a CPU machine, else the running JAX backend's.

    Raises:
        AxcoreError subclasses naming the offending file, key, path or plugin.
    """
    raw, label = read_experiment_file(source, objects=objects)
    parsed = [parse_override(o) for o in overrides]
    for path, value in parsed:
        if path == "plugins":
            raw["plugins"] = value
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list):
        raise ConfigError(f"{label}: 'plugins' must be a list of plugin names, got {plugins!r}.")
    selected = _selected_instance_type(raw, parsed)
    platform = platform or (selected.split("-", 1)[0] if selected else _platform())
    manager = create_plugin_manager(plugins, objects=objects, platform=platform)
    plugin_names = [PluginRequest.parse(p).name for p in plugins]
    fields = ExperimentConfig().keys()
    settings_raw: dict[str, Any] = {}
    for key in [k for k in raw if k not in fields]:
        if key not in plugin_names:
            hint = did_you_mean(str(key), fields + plugin_names)
            raise UnknownFieldError(
                f"{label}: unknown top-level key '{key}'{hint}; expected one of {', '.join(fields)} "
                f"or the name of a plugin listed in 'plugins'."
            )
        settings_raw[key] = raw.pop(key)
    config = from_dict(raw, manager.registries, ExperimentConfig())
    for path, value in parsed:
        head = path.split(".", 1)[0].split("[", 1)[0]
        if path == "plugins":
            continue
        if head in plugin_names:
            _deep_merge(settings_raw, nest_path(path, value))
        else:
            config = from_dict(nest_path(path, value), manager.registries, config)
    settings = manager.settings(settings_raw)
    config = manager.transform_config(config, settings)
    if not isinstance(config, ExperimentConfig):
        raise ConfigError("A plugin's config transform replaced the experiment root; transform its parts only.")
    config = resolve_mesh(config, manager)
    check_experiment_config(config, manager)
    return Experiment(config, manager, settings, label)


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
    """Fills `config.mesh` from the matching mesh rule and applies its config modifiers."""
    config = config.clone()
    mesh = config.mesh
    rules = manager.registries.mesh_rules
    if mesh.instance_type is None:
        mesh.instance_type = detect_instance_type()
    rule = rules[mesh.rule] if mesh.rule is not None else select_mesh_rule([rules[n] for n in rules], mesh.instance_type)
    mesh.rule = rule.name
    if mesh.mesh_shape is None:
        mesh.mesh_shape = tuple(rule.mesh_shape)
    if mesh.mesh_axis_names is None:
        mesh.mesh_axis_names = tuple(rule.mesh_axis_names)
    if mesh.axis_rules is None:
        mesh.axis_rules = {k: (list(v) if isinstance(v, tuple) else v) for k, v in rule.axis_rules.items()}
    for modifier in rule.config_modifiers:
        new = modifier(config)
        if not isinstance(new, ExperimentConfig):
            raise ConfigError(
                f"Config modifier {getattr(modifier, '__name__', modifier)!r} of mesh rule "
                f"'{rule.name}' returned {type(new).__name__}; modifiers must return the new config."
            )
        config = new
    return config
