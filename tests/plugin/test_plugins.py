"""The plugin manager: throwaway plugins, registries, conflicts and config transforms."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import ConfigBase, find, from_yaml, replace
from axcore.errors import (
    ConfigError,
    DuplicateComponentError,
    NoMatchError,
    PluginConflictError,
    PluginLoadError,
    UnknownFieldError,
    UnknownPluginError,
)
from axcore.kernels import SUPPORTED, AttentionProblem, Op, Problem
from axcore.layers import CausalLM, FeedForward, LearnedPositionEmbedding, MultiheadAttention, PositionEmbedding
from axcore.platform.mesh import MeshRule, select_mesh_rule


class DoubledFeedForward(FeedForward):
    """A third-party layer: twice the feed-forward output."""

    def forward(self, x):
        return 2.0 * super().forward(x)


class NoPosition(PositionEmbedding):
    """A third-party position embedding that changes nothing."""


class ScaleSettings(ConfigBase):
    """Settings of the throwaway plugin."""

    # Softmax scale to install in every attention layer.
    scale: float = 0.125


class ThrowawayPlugin:
    @axcore.hookimpl
    def axcore_register_layers(self, register):
        register("doubled_feed_forward", DoubledFeedForward)

    @axcore.hookimpl
    def axcore_settings_config(self):
        return ScaleSettings()

    @axcore.hookimpl
    def axcore_transform_config(self, config, settings):
        return replace(config, MultiheadAttention, lambda path, c: c.set(scale=settings.scale))


def _decoder_yaml(layers_as_list: bool) -> str:
    layer = (
        "  layer:\n"
        "    self_attention: {num_heads: 2}\n"
        "    feed_forward: {type: doubled_feed_forward, hidden_dim: 16}\n"
    )
    if layers_as_list:
        layer = "  layer:\n" + "".join(
            f"  - self_attention: {{num_heads: 2}}\n    feed_forward: {{type: doubled_feed_forward, hidden_dim: {8 * (i + 1)}}}\n"
            for i in range(4)
        )
    return "vocab_size: 32\ndim: 8\nnum_layers: 4\ndecoder:\n" + layer


def _base():
    return CausalLM.default_config()


def test_throwaway_layer_is_usable_by_name_from_yaml():
    pm = axcore.create_plugin_manager(["mine"], objects={"mine": ThrowawayPlugin})
    cfg = from_yaml(_decoder_yaml(False), pm.registries, _base())
    model = cfg.instantiate(name="model", registries=pm.registries)
    assert isinstance(model.decoder.layer3.feed_forward, DoubledFeedForward)
    params = model.initialize(jax.random.key(0))
    ids = jnp.arange(10).reshape(2, 5) % 32
    batch = {"input_ids": ids, "target_labels": ids}
    loss, _ = jax.jit(lambda p: axcore.functional(model, p, (batch,), None, False)[0])(params)
    assert np.isfinite(loss)


def test_without_the_plugin_its_layer_name_is_unknown():
    pm = axcore.create_plugin_manager()
    with pytest.raises(axcore.UnknownComponentError, match="doubled_feed_forward"):
        from_yaml(_decoder_yaml(False), pm.registries, _base())


@pytest.mark.parametrize("layers_as_list", [False, True])
def test_transform_edits_every_attention_layer_of_a_4_layer_decoder(layers_as_list):
    pm = axcore.create_plugin_manager(["mine"], objects={"mine": ThrowawayPlugin})
    cfg = from_yaml(_decoder_yaml(layers_as_list), pm.registries, _base())
    settings = pm.settings({"mine": {"scale": 0.3}})
    new = pm.transform_config(cfg, settings)
    assert all(c.scale == 0.3 for _, c in find(new, MultiheadAttention))
    assert all(c.scale is None for _, c in find(cfg, MultiheadAttention))  # Input untouched.
    model = new.instantiate(name="model", registries=pm.registries)
    scales = [getattr(model.decoder, f"layer{i}").self_attention.config.scale for i in range(4)]
    assert scales == [0.3] * 4


def test_transform_runs_only_for_enabled_plugins():
    pm = axcore.create_plugin_manager()
    pm.register_plugin(ThrowawayPlugin(), "mine", enabled=False)
    cfg = from_yaml(_decoder_yaml(False).replace("type: doubled_feed_forward, ", ""), pm.registries, _base())
    assert pm.transform_config(cfg) == cfg


class SetScale:
    """Sets every attention layer's scale to a fixed value."""

    def __init__(self, value):
        self.value = value

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(config, MultiheadAttention, lambda p, c: c.set(scale=self.value))


class ScaledAttention(MultiheadAttention):
    """A subclass a plugin swaps in, keeping every field of the attention it replaces."""


class SwapAttention:
    """Replaces every attention config by a ScaledAttention config with the same fields."""

    def __init__(self):
        self.seen_scales = []

    @axcore.hookimpl
    def axcore_register_layers(self, register):
        register("scaled_attention", ScaledAttention)

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        def swap(path, c):
            self.seen_scales.append(c.scale)
            return ScaledAttention.default_config().set(**dict(c.items()))

        return replace(config, MultiheadAttention, swap)


@pytest.mark.parametrize("order", [["scale", "swap"], ["swap", "scale"]])
def test_transforms_compose_in_plugins_order(order):
    swap = SwapAttention()
    pm = axcore.create_plugin_manager(order, objects={"scale": SetScale(2.0), "swap": swap})
    new = pm.transform_config(_base())
    found = find(new, MultiheadAttention)
    assert [c.klass for _, c in found] == [ScaledAttention] and found[0][1].scale == 2.0
    # The swap saw the scale only when the scale plugin ran first.
    assert swap.seen_scales == ([2.0] if order[0] == "scale" else [None])


class DropPositions:
    """Empties every attention's position-embedding slot."""

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(config, MultiheadAttention, lambda p, c: c.set(position_embedding=None))


class LearnedInAttention:
    """Puts a learned embedding config into every attention's position-embedding slot."""

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        pe = LearnedPositionEmbedding.default_config().set(max_len=8)
        return replace(config, MultiheadAttention, lambda p, c: c.set(position_embedding=pe.clone()))


def test_removing_or_replacing_another_plugins_component_conflicts():
    objects = {"learned": LearnedInAttention(), "drop": DropPositions(), "nopos": NoPositionInAttention()}
    for order in (["learned", "drop"], ["learned", "nopos"], ["nopos", "learned"]):
        pm = axcore.create_plugin_manager(order, objects=objects)
        with pytest.raises(PluginConflictError, match=rf"'{order[0]}' and '{order[1]}' both set config .*position_embedding"):
            pm.transform_config(_base())


class NoPositionInAttention:
    """Puts NoPosition into every attention's slot (registering it)."""

    @axcore.hookimpl
    def axcore_register_position_embeddings(self, register):
        register("no_position", NoPosition)

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(config, MultiheadAttention, lambda p, c: c.set(position_embedding=NoPosition.default_config()))


def test_two_plugins_writing_one_value_conflict():
    pm = axcore.create_plugin_manager(["one", "two"], objects={"one": SetScale(1.0), "two": SetScale(2.0)})
    with pytest.raises(PluginConflictError, match=r"'one' and 'two' both set config 'decoder\.layer\.self_attention\.scale'"):
        pm.transform_config(_base())


def test_plugins_agreeing_on_a_value_do_not_conflict():
    pm = axcore.create_plugin_manager(["one", "two"], objects={"one": SetScale(1.0), "two": SetScale(1.0)})
    assert {c.scale for _, c in find(pm.transform_config(_base()), MultiheadAttention)} == {1.0}


def test_transform_that_matches_nothing_names_the_plugin():
    class NoAttention:
        @axcore.hookimpl
        def axcore_transform_config(self, config):
            return replace(config, DoubledFeedForward, lambda p, c: c)

    pm = axcore.create_plugin_manager(["noop"], objects={"noop": NoAttention()})
    with pytest.raises(NoMatchError, match="Plugin 'noop'"):
        pm.transform_config(_base())


def test_transform_must_return_a_config():
    class Forgetful:
        @axcore.hookimpl
        def axcore_transform_config(self, config):
            config.dim = 3  # Edits in place and returns nothing.

    pm = axcore.create_plugin_manager(["forgetful"], objects={"forgetful": Forgetful()})
    with pytest.raises(PluginLoadError, match="forgetful.*must return the new config"):
        pm.transform_config(_base())


def test_settings_are_validated_with_suggestions():
    pm = axcore.create_plugin_manager(["mine"], objects={"mine": ThrowawayPlugin})
    with pytest.raises(UnknownFieldError, match=r"'mine\.scael'.*did you mean 'scale'"):
        pm.settings({"mine": {"scael": 1.0}})
    with pytest.raises(ConfigError, match="not enabled: rope"):
        pm.settings({"rope": {"theta": 1.0}})
    assert pm.settings()["mine"].scale == 0.125


class Fake:
    priority = 5

    def __init__(self, name="fake"):
        self.name = name

    def is_supported(self, problem):
        return SUPPORTED

    def __call__(self, *args, **kwargs):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormProblem(Problem):
    """A made-up op's problem."""

    dim: int = 0


class RegistersEverything:
    """Registers one component of every kind, each named `<prefix><kind>`."""

    def __init__(self, prefix="", override=False):
        self.prefix, self.override = prefix, override

    def _name(self, kind):
        return self.prefix + kind

    @axcore.hookimpl
    def axcore_register_layers(self, register):
        register(self._name("linear"), DoubledFeedForward, override=self.override)

    @axcore.hookimpl
    def axcore_register_position_embeddings(self, register):
        register(self._name("learned_position_embedding"), NoPosition, override=self.override)

    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        register(Fake(self._name("fake")), override=self.override)

    @axcore.hookimpl
    def axcore_register_ops(self, register):
        register(Op(self._name("rms_norm"), NormProblem, Fake("reference")), override=self.override)

    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register(self._name("rms_norm"), Fake(self._name("norm_fake")), override=self.override)

    @axcore.hookimpl
    def axcore_register_mesh_rules(self, register):
        register(MeshRule(self._name("cpu"), r"cpu-\d+", (-1,), ("data",)), override=self.override)

    @axcore.hookimpl
    def axcore_register_checkpoint_backends(self, register):
        register(self._name("raw"), dict, override=self.override)

    @axcore.hookimpl
    def axcore_register_data_sources(self, register):
        register(self._name("lines"), axcore.Configurable, override=self.override)


def test_every_registration_hook_fills_its_registry():
    regs = axcore.create_plugin_manager(["all"], objects={"all": RegistersEverything(override=True)}).registries
    assert regs.layers["linear"] is DoubledFeedForward  # Replaced the built-in explicitly.
    assert regs.position_embeddings["learned_position_embedding"] is NoPosition
    attention = AttentionProblem.of(np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 2, 4)))
    assert regs.kernels.select("attention", attention).name == "fake"  # Priority 5 beats xla's 0.
    assert regs.ops["rms_norm"].problem_type is NormProblem
    assert [k.name for k in regs.kernels.candidates("rms_norm")] == ["norm_fake", "reference"]
    assert select_mesh_rule([regs.mesh_rules[n] for n in regs.mesh_rules], "cpu-8").name == "cpu"
    assert regs.checkpoint_backends["raw"] is dict
    assert regs.lookup("lines") is axcore.Configurable  # Data sources are config-nameable.
    assert regs.layers.entry("linear").provenance.plugin == "all"


def test_duplicate_name_names_both_distributions():
    class Dup:
        @axcore.hookimpl
        def axcore_register_layers(self, register):
            register("linear", DoubledFeedForward)

    pm = axcore.create_plugin_manager(["dup"], objects={"dup": Dup()})
    with pytest.raises(DuplicateComponentError, match=r"'linear'.*distribution axcore.*plugin 'dup'"):
        _ = pm.registries


@pytest.mark.parametrize(
    "kind",
    ["layer", "position embedding", "'attention' kernel", "'x_rms_norm' kernel", "op", "mesh rule",
     "checkpoint backend", "data source"],
)
def test_duplicates_between_two_plugins_in_every_registry(kind):
    class Only(RegistersEverything):
        """Registers only the component(s) of `kind` under one name (others get unique names)."""

        def _name(self, k):
            wanted = {"layer": {"linear"}, "position embedding": {"learned_position_embedding"},
                      "mesh rule": {"cpu"}, "checkpoint backend": {"raw"}, "data source": {"lines"},
                      "'x_rms_norm' kernel": {"norm_fake", "rms_norm"}, "op": {"rms_norm"}}.get(kind, {"fake"})
            return "x_" + k if k in wanted else self.prefix + k

    pm = axcore.create_plugin_manager(["a", "b"], objects={"a": Only("a_"), "b": Only("b_")})
    with pytest.raises(DuplicateComponentError, match=rf"Two {kind}s named .*plugin 'a'.*plugin 'b'"):
        _ = pm.registries


def test_name_may_not_be_both_layer_and_position_embedding():
    class Both:
        @axcore.hookimpl
        def axcore_register_position_embeddings(self, register):
            register("linear", NoPosition)

    with pytest.raises(DuplicateComponentError, match="both as a layer"):
        _ = axcore.create_plugin_manager(["both"], objects={"both": Both()}).registries


def test_explicit_override_wins():
    pm = axcore.create_plugin_manager(["all"], objects={"all": RegistersEverything(override=True)})
    assert pm.registries.layers["linear"] is DoubledFeedForward


def test_unknown_plugin_lists_installed_names():
    with pytest.raises(UnknownPluginError, match=r"'mnie'.*did you mean 'mine'.*installed plugins: .*mine"):
        axcore.create_plugin_manager(["mnie"], objects={"mine": ThrowawayPlugin})


@pytest.mark.parametrize("entry", ["rope>>1", "rope[x]", 3, "rope; python_version>'3'"])
def test_malformed_plugin_entries(entry):
    with pytest.raises(ConfigError, match=r"plugins\[0\]"):
        axcore.create_plugin_manager([entry])


def test_plugin_listed_twice():
    with pytest.raises(ConfigError, match="more than once"):
        axcore.create_plugin_manager(["mine", "mine"], objects={"mine": ThrowawayPlugin})


def test_misspelled_hook_fails_loudly():
    class Typo:
        @axcore.hookimpl
        def axcore_register_layer(self, register):
            pass

    with pytest.raises(PluginLoadError, match="axcore_register_layer"):
        axcore.create_plugin_manager(["typo"], objects={"typo": Typo()})


def test_hook_with_unknown_argument_fails_loudly():
    class BadArgs:
        @axcore.hookimpl
        def axcore_transform_config(self, config, colour):
            return config

    with pytest.raises(PluginLoadError, match="badargs.*colour"):
        axcore.create_plugin_manager(["badargs"], objects={"badargs": BadArgs()})


def test_hooks_of_and_plugin_listing():
    pm = axcore.create_plugin_manager(["mine"], objects={"mine": ThrowawayPlugin})
    assert pm.hooks_of("mine") == ["axcore_register_layers", "axcore_settings_config", "axcore_transform_config"]
    assert [p.source for p in pm.plugins][-1] == "object"
    assert {p.source for p in pm.plugins[:-1]} == {"builtin"}
