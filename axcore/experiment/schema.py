"""The experiment schema: `ExperimentConfig`, the typed root of every experiment file.

Each field is a top-level key of an experiment file (docs/experiments.md is generated
from these classes' field comments by `axcore_devtools.experiment_reference`). Loading a file
into this tree is `axcore.experiment.loading.load_experiment`'s job; this module only declares
it, plus the checks of components the registries must know (`check_experiment_config`).

Layer: experiment (imports config, data, layers, trainer's config; never the plugin
manager or the loader).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from axcore.config import REQUIRED, ConfigBase, InstantiableConfig, Matches
from axcore.data import ByteTokenizer, InputConfig, Tokenizer
from axcore.layers import CausalLM
from axcore.trainer.config import TrainerConfig, check_trainer_config
from axcore.trainer.learner import check_component

if TYPE_CHECKING:
    from axcore.plugin.loading import AxcorePluginManager


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
    """An experiment's own mesh rule (a `mesh_rules:` entry); precedence in `axcore.platform.mesh`."""

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
    # Config modifiers applied in order: {type: NAME, ...arguments} (axcore.experiment.config_modifiers).
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
    # The experiment's own mesh rules, tried before registered ones (see axcore.platform.mesh).
    mesh_rules: list[MeshRuleConfig] = []
    # XLA flags {name: value} (no leading --) over the plugins' for the instance type; null removes one.
    xla_flags: dict[str, Any] = {}
    # Fine-tune from this run directory: its experiment is the base this one merges onto, its latest parameters start training.
    init_from: str | None = None


def check_experiment_config(config: ExperimentConfig, manager: AxcorePluginManager) -> None:
    """Checks the components the registries must know (optimizer, schedule, writers, tokenizer, backend)."""
    registries = manager.registries
    check_component(config.tokenizer, Tokenizer, "tokenizer", names=registries.tokenizers.names())
    check_trainer_config(config.trainer, registries)
