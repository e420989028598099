"""Experiment files: plugins, plugin settings, overrides, transforms and mesh resolution."""

import pytest

import axcore
from axcore.config import ConfigBase, find, replace
from axcore.data import ByteTokenizer
from axcore.errors import ConfigError, ConfigTypeError, UnknownFieldError, UnknownPluginError
from axcore.experiment import builtin_experiments, load_experiment, search_plugins
from axcore.layers import MultiheadAttention


class HeadsSettings(ConfigBase):
    """Settings of the test plugin."""

    # Number of heads to install.
    num_heads: int = 8


class Heads:
    @axcore.hookimpl
    def axcore_settings_config(self):
        return HeadsSettings()

    @axcore.hookimpl
    def axcore_transform_config(self, config, settings):
        return replace(config, MultiheadAttention, lambda p, c: c.set(num_heads=settings.num_heads))


def _write(tmp_path, text):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return str(path)


def test_default_experiment_is_builtin():
    assert "default" in builtin_experiments()
    exp = load_experiment(None)
    assert exp.config.name == "default" and exp.config.model.num_layers == 4
    assert exp.config.mesh.instance_type.startswith("cpu-") and exp.config.mesh.rule == "default"
    assert exp.config.mesh.mesh_axis_names == ("data",)


def test_file_merges_onto_default_and_plugin_settings_apply(tmp_path):
    path = _write(tmp_path, "plugins: [heads]\nheads: {num_heads: 2}\nmodel: {num_layers: 2}\n")
    exp = load_experiment(path, objects={"heads": Heads()})
    assert exp.config.model.num_layers == 2 and exp.config.model.dim == 256
    assert {c.num_heads for _, c in find(exp.config, MultiheadAttention)} == {2}
    assert "heads.num_heads: 2" in exp.flat()
    assert exp.to_dict()["heads"] == {"num_heads": 2}


def test_listed_but_unconfigured_plugin_uses_defaults_and_unlisted_changes_nothing(tmp_path):
    with_plugin = load_experiment(_write(tmp_path, "plugins: [heads]\n"), objects={"heads": Heads()})
    assert {c.num_heads for _, c in find(with_plugin.config, MultiheadAttention)} == {8}
    without = load_experiment(_write(tmp_path, "plugins: []\n"), objects={"heads": Heads()})
    assert {c.num_heads for _, c in find(without.config, MultiheadAttention)} == {4}


def test_overrides_reach_config_plugin_settings_and_plugin_list(tmp_path):
    path = _write(tmp_path, "model: {num_layers: 2}\n")
    exp = load_experiment(
        path,
        ["plugins=[heads]", "heads.num_heads=1", "trainer.max_steps=7", "model.num_layers=3"],
        objects={"heads": Heads()},
    )
    assert exp.config.trainer.max_steps == 7 and exp.config.model.num_layers == 3
    assert {c.num_heads for _, c in find(exp.config, MultiheadAttention)} == {1}


@pytest.mark.parametrize(
    "text,overrides,error,pattern",
    [
        ("modle: {}\n", [], UnknownFieldError, r"exp\.yaml: unknown top-level key 'modle' \(did you mean 'model'\?\)"),
        ("heads: {num_heads: 2}\n", [], UnknownFieldError, "top-level key 'heads'"),
        ("plugins: [heads]\nheads: {num_hedas: 2}\n", [], UnknownFieldError, r"'heads\.num_hedas'.*'num_heads'"),
        ("", ["model.num_layres=2"], UnknownFieldError, r"'model\.num_layres'.*did you mean 'num_layers'"),
        ("", ["trainer.max_steps=many"], ConfigTypeError, r"'trainer\.max_steps' expects int"),
        ("plugins: rope\n", [], ConfigError, "must be a list"),
        ("plugins: [nosuchplugin]\n", [], UnknownPluginError, "nosuchplugin"),
        ("model: [1, 2\n", [], ConfigError, r"exp\.yaml: invalid YAML"),
        ("- a\n", [], ConfigError, "must be a mapping"),
    ],
)
def test_bad_experiments_name_the_problem(tmp_path, text, overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        load_experiment(_write(tmp_path, text), overrides, objects={"heads": Heads()})


def test_unknown_experiment_name():
    with pytest.raises(ConfigError, match="neither a file nor a built-in experiment"):
        load_experiment("no/such/file.yaml")
    with pytest.raises(ConfigError, match=r"'scna' .*\(did you mean 'scan'\?\); available: default, llama2_7b, llama3_70b, scan, sft"):
        load_experiment("scna")


def test_builtin_experiments_are_registered_by_a_builtin_plugin(registries):
    assert builtin_experiments() == ["default", "llama2_7b", "llama3_70b", "scan", "sft"]
    entry = registries.experiments.entry("scan")
    assert entry.provenance.plugin == "axcore.experiments.plugin" and entry.provenance.distribution == "axcore"
    assert load_experiment("scan").source == "<built-in experiment scan>"


class ShipsExperiments:
    @axcore.hookimpl
    def axcore_register_experiments(self, register):
        register("from_text", "name: from_text\ntrainer: {max_steps: 7}\n")


def test_plugin_experiments_from_text_and_file_load_by_name(tmp_path):
    exp = load_experiment("from_text", objects={"ships": ShipsExperiments()})
    assert exp.config.name == "from_text" and exp.config.trainer.max_steps == 7
    assert exp.source == "<experiment from_text of plugin 'ships' (distribution <local>)>"
    # Shipping an experiment does not enable the plugin; the experiment's `plugins:` decides.
    assert "ships" not in [info.name for info in exp.plugin_manager.plugins]
    file = tmp_path / "shipped.yaml"
    file.write_text("name: from_file\ninput: {batch_size: 3}\n")

    class ShipsFile:
        @axcore.hookimpl
        def axcore_register_experiments(self, register):
            register("from_file", file)

    exp = load_experiment("from_file", ["input.seq_len=16"], objects={"ships": ShipsFile()})
    assert exp.config.name == "from_file" and exp.config.input.batch_size == 3 and exp.config.input.seq_len == 16


def test_installed_plugins_are_searched_one_by_one_unless_autoload_is_disabled(monkeypatch):
    found = search_plugins("layers").found
    # Layers of installed plugins (the repo's moe and swiglu), though none is enabled anywhere.
    installed = {name for name, entry in found.items() if entry.provenance.distribution != "axcore"}
    assert installed and found["linear"].provenance.distribution == "axcore"
    assert not installed & set(search_plugins("layers", name="linear").found)  # A built-in name: no search.
    monkeypatch.setenv("AXCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert not installed & set(search_plugins("layers").found)


def test_tokenizer_is_configurable_and_checked(tmp_path):
    exp = load_experiment(_write(tmp_path, "tokenizer: {type: bytes}\n"))
    assert isinstance(exp.config.tokenizer.instantiate(), ByteTokenizer)
    with pytest.raises(ConfigError, match=r"'tokenizer' builds 'CausalLM', which is not a tokenizer"):
        load_experiment(_write(tmp_path, "tokenizer: {type: causal_lm}\n"))


def test_mesh_can_be_forced(tmp_path):
    exp = load_experiment(None, ["mesh.instance_type=gpu-h100-8"])
    assert exp.config.mesh.instance_type == "gpu-h100-8" and exp.config.mesh.rule == "default"
