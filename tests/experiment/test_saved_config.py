"""A run directory's config.yaml loads back to exactly the resolved config that ran: plugin
transforms and mesh-rule modifiers are not applied twice (`Experiment.save`, `resolved_by`)."""

import pathlib

import pytest
import yaml

import axcore
from axcore.cli import main
from axcore.config import replace
from axcore.errors import AxcoreError, ConfigError
from axcore.experiment import RESOLVED_KEY, builtin_experiments, load_experiment
from axcore.layers import CausalLM, FeedForward
from axcore.plugin.loading import installed_entry_points

FIXED_MESH = "mesh.instance_type=cpu-1"


def double_hidden_dim():
    """A mesh-rule modifier that is not idempotent: every feed-forward's hidden_dim doubles."""

    def modify(config):
        return replace(config, FeedForward, lambda _, c: c.set(hidden_dim=2 * c.hidden_dim))

    return modify


class Doubler:
    """A plugin whose config transform is not idempotent: it doubles the model's num_layers."""

    @axcore.hookimpl
    def axcore_register_config_modifiers(self, register):
        register("double_hidden_dim", double_hidden_dim)

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(config, CausalLM, lambda _, c: c.set(num_layers=2 * c.num_layers))


EXPERIMENT = """\
plugins: [doubler]
model: {num_layers: 3}
mesh_rules:
  - {name: local, instance_type: 'cpu-.*', modifiers: [{type: double_hidden_dim}]}
"""


def _dims(exp):
    return exp.config.model.num_layers, exp.config.model.decoder.layer.feed_forward.hidden_dim


def test_non_idempotent_transform_and_modifier_are_not_applied_twice(tmp_path):
    objects = {"doubler": Doubler()}
    source = tmp_path / "exp.yaml"
    source.write_text(EXPERIMENT)
    exp = load_experiment(source, [FIXED_MESH], objects=objects)
    assert _dims(exp) == (6, 2048) and exp.mesh_modifiers == ["modify"]
    run = tmp_path / "run"
    exp.save(run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert next(iter(saved)) == RESOLVED_KEY
    assert saved[RESOLVED_KEY]["plugins"] == ["doubler"]
    assert saved[RESOLVED_KEY]["mesh_rule"] == "local (experiment mesh_rules[0])"

    again = load_experiment(run / "config.yaml", objects=objects)
    assert _dims(again) == (6, 2048)
    assert again.flat() == exp.flat() == (run / "config.txt").read_text()
    # Saved again from the loaded experiment: the same file (a resume of a resume).
    again.save(tmp_path / "run2")
    assert (tmp_path / "run2" / "config.yaml").read_text() == (run / "config.yaml").read_text()
    # Overrides still apply on top; nothing is re-resolved.
    longer = load_experiment(run / "config.yaml", ["trainer.max_steps=7"], objects=objects)
    assert _dims(longer) == (6, 2048) and longer.config.trainer.max_steps == 7

    # The same file without the marker (an older run directory) is resolved in full again:
    # that is the double application the marker prevents.
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text(yaml.safe_dump({k: v for k, v in saved.items() if k != RESOLVED_KEY}, sort_keys=False))
    assert _dims(load_experiment(legacy, objects=objects)) == (12, 4096)


def test_a_resolved_config_keeps_its_plugins(tmp_path):
    objects = {"doubler": Doubler()}
    exp = load_experiment(None, ["plugins=[doubler]", FIXED_MESH], objects=objects)
    exp.save(tmp_path)
    with pytest.raises(ConfigError, match=r"resolved config .*\['doubler'\].*'plugins' is \['doubler', 'swiglu'\]"):
        load_experiment(tmp_path / "config.yaml", ["plugins=[doubler, swiglu]"], objects=objects)
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"{RESOLVED_KEY}: [doubler]\n")
    with pytest.raises(ConfigError, match=f"'{RESOLVED_KEY}' must be a mapping"):
        load_experiment(bad)


# Feature plugins enabled together, per built-in experiment: every combination that resolves
# with each feature plugin in at least one (rope and alibi both fill the position-embedding
# slot; remat needs a scanned stack; the llama experiments configure rope themselves).
FEATURES = {"alibi", "lora", "moe", "remat", "rope", "swiglu"}
PLUGINS_DIR = pathlib.Path(__file__).parents[2] / "plugins"
# Plugin directories that hold no model feature (they add tokenizers, converters (model families included) or an
# objective (and rewards), not config transforms of the model).
NOT_FEATURES = {"dpo", "hf", "moe_families", "tokenizers", "qwen", "gemma", "rl"}
COMBINATIONS = {
    "default": [["rope", "swiglu", "moe"], ["alibi", "moe", "swiglu", "lora"]],
    "scan": [["rope", "swiglu", "moe", "remat", "lora"], ["alibi", "swiglu", "moe", "remat"]],
    "llama2_7b": [["rope", "swiglu", "moe", "remat", "lora"]],
    "llama3_70b": [["rope", "swiglu", "moe", "remat", "lora"]],
    "sft": [["rope", "swiglu", "moe"], ["alibi", "moe", "swiglu", "lora"]],
}


# The feature plugins left out of an experiment's combinations, each because it does not resolve.
LEFT_OUT = {"default": ["remat"], "scan": [], "llama2_7b": ["alibi"], "llama3_70b": ["alibi"], "sft": ["remat"]}


def test_combinations_cover_every_builtin_experiment_and_feature_plugin():
    assert sorted(COMBINATIONS) == sorted(builtin_experiments()) == sorted(LEFT_OUT)
    assert {p.name for p in PLUGINS_DIR.iterdir() if (p / "pyproject.toml").is_file()} - NOT_FEATURES == FEATURES
    assert FEATURES <= set(installed_entry_points())
    for name, combinations in COMBINATIONS.items():
        assert {p for c in combinations for p in c} | set(LEFT_OUT[name]) == FEATURES, name
        for plugin in LEFT_OUT[name]:
            with pytest.raises(AxcoreError):
                load_experiment(name, [f"plugins=[{plugin}]", FIXED_MESH])


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_axcore_config_of_a_saved_config_prints_the_runs_config_txt(name, tmp_path, capsys):
    for i, plugins in enumerate(COMBINATIONS[name]):
        exp = load_experiment(name, [f"plugins=[{', '.join(plugins)}]", FIXED_MESH])
        run = tmp_path / str(i)
        exp.save(run)
        capsys.readouterr()
        assert main(["config", str(run / "config.yaml")]) == 0
        out = capsys.readouterr().out
        printed = "".join(line for line in out.splitlines(True) if not line.startswith(("# kernel ", "# data check: ")))
        assert printed == (run / "config.txt").read_text(), (name, plugins)
        # The kernel lines and the data check follow, as for any experiment.
        assert out.count("# kernel ") >= 2 and out.count("# data check: ") == 1
