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
import importlib.resources
import os
from collections.abc import Sequence
from typing import Any

import yaml

from axcore.config import ConfigBase, InstantiableConfig, dump_flat, from_dict, parse_override
from axcore.config.serialize import flatten, format_value, nest_path, safe_load, to_dict
from axcore.data import InputConfig
from axcore.errors import ConfigError, UnknownFieldError, did_you_mean
from axcore.layers import CausalLM
from axcore.mesh import detect_instance_type, select_mesh_rule
from axcore.plugins import AxcorePluginManager, PluginRequest, create_plugin_manager
from axcore.trainer.config import TrainerConfig

BUILTIN_EXPERIMENTS = "axcore.experiments"


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

    def to_dict(self) -> dict[str, Any]:
        """The resolved experiment as YAML-safe data (config plus plugin settings)."""
        data = to_dict(self.config, self.registries)
        for name, settings in self.settings.items():
            if settings is not None:
                data[name] = to_dict(settings, self.registries)
        return data


def builtin_experiments() -> list[str]:
    """Names of the experiments shipped with axcore."""
    files = importlib.resources.files(BUILTIN_EXPERIMENTS).iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def read_experiment_file(source: str | os.PathLike | None) -> tuple[dict, str]:
    """Raw YAML mapping of a file path or built-in name (None = "default")."""
    source = "default" if source is None else os.fspath(source)
    if os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            text, label = f.read(), source
    elif source in builtin_experiments():
        text = importlib.resources.files(BUILTIN_EXPERIMENTS).joinpath(f"{source}.yaml").read_text("utf-8")
        label = f"<built-in experiment {source}>"
    else:
        raise ConfigError(
            f"Experiment '{source}' is neither a file nor a built-in experiment "
            f"({', '.join(builtin_experiments())}); check the path."
        )
    try:
        data = safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{label}: invalid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: an experiment file must be a mapping, got {type(data).__name__}.")
    return data, label


def _platform() -> str:
    import jax  # Deferred: resolving a config needs JAX, --help does not.

    platform = jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def load_experiment(
    source: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    objects: dict[str, Any] | None = None,
    platform: str | None = None,
) -> Experiment:
    """Reads, overrides, transforms and lays out an experiment.

    Args:
        source: a YAML file path or a built-in experiment name; None = "default".
        overrides: `PATH=VALUE` strings (YAML-typed values), applied after the file;
            paths may start with a plugin name to set that plugin's settings, and
            `plugins=[...]` replaces the list.
        objects: plugin objects by name, registered directly (tests, notebooks).
        platform: hardware platform whose plugin is autoloaded; None = detected.

    Raises:
        AxcoreError subclasses naming the offending file, key, path or plugin.
    """
    raw, label = read_experiment_file(source)
    parsed = [parse_override(o) for o in overrides]
    for path, value in parsed:
        if path == "plugins":
            raw["plugins"] = value
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list):
        raise ConfigError(f"{label}: 'plugins' must be a list of plugin names, got {plugins!r}.")
    manager = create_plugin_manager(plugins, objects=objects, platform=platform or _platform())
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
    return Experiment(config, manager, settings, label)


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
