"""The `rope` plugin (distribution axcore-rope) through its real entry point.

Needs axcore-rope installed (`pip install ./plugins/rope`): experiments with
`plugins: [rope]`, the CLI, scanned/unrolled/encoder stacks, training, conflicts.
"""

import inspect
import pathlib
import re
import subprocess
import sys
import tokenize

import jax
import numpy as np
import pytest
import yaml

import axcore
from axcore.config import find, replace
from axcore.errors import ConfigError, ConfigTypeError, PluginConflictError, UnknownFieldError
from axcore.experiment import load_experiment, read_experiment_file
from axcore.layers import (
    LearnedPositionEmbedding,
    MultiheadAttention,
    StackedTransformer,
    TransformerLayer,
)
from axcore.params import ParameterSpec
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

from axcore_rope import RotaryEmbedding, plugin

REPO = pathlib.Path(__file__).resolve().parents[3]
SLOT = "model.decoder.layer.self_attention.position_embedding"
TINY = TINY_OVERRIDES


def _write(tmp_path, data, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def _default_with(**extra):
    """The built-in default experiment's YAML data plus `extra` top-level keys."""
    raw, _ = read_experiment_file(None)
    return {**raw, **extra}


def _random_params(model, seed=0):
    """Random parameters of the right shapes, without the (compiling) initializers."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        return (rng.normal(size=spec.shape) / np.sqrt(spec.shape[0])).astype(np.float32)

    return jax.tree.map(draw, model.parameter_specs(), is_leaf=lambda x: isinstance(x, ParameterSpec))


def _rotary_slots(config):
    return [(path, cfg) for path, cfg in find(config, RotaryEmbedding)]


def _assert_rotary_everywhere(config, theta):
    attention = find(config, MultiheadAttention)
    rotary = _rotary_slots(config)
    assert len(attention) >= 1 and len(rotary) == len(attention)
    assert [p for p, _ in rotary] == [f"{p}.position_embedding" for p, _ in attention]
    assert {c.theta for _, c in rotary} == {theta}
    assert not find(config, LearnedPositionEmbedding)


def test_loaded_by_name_from_its_entry_point():
    pm = axcore.create_plugin_manager(["rope>=0.1"])
    info = pm.plugins[-1]
    assert (info.name, info.distribution, info.version, info.source) == ("rope", "axcore-rope", "0.1.0", "entry-point")
    assert info.plugin is plugin
    assert pm.hooks_of("rope") == [
        "axcore_register_position_embeddings",
        "axcore_settings_config",
        "axcore_transform_config",
    ]
    assert pm.registries.position_embeddings["rotary"] is RotaryEmbedding
    assert "rotary" not in axcore.create_plugin_manager().registries.position_embeddings


def test_experiment_file_installs_rotary_in_every_attention_layer(tmp_path):
    path = _write(tmp_path, _default_with(plugins=["rope"], rope={"theta": 500000}))
    exp = load_experiment(path)
    _assert_rotary_everywhere(exp.config, 500000.0)
    assert exp.config.model.position_embedding is None
    flat = exp.flat()
    assert f"{SLOT}.type: rotary\n" in flat and f"{SLOT}.theta: 500000.0\n" in flat
    assert "model.position_embedding: null\n" in flat and "rope.theta: 500000.0\n" in flat
    # Exactly the position-embedding slots, the plugin list and the settings change.
    without = load_experiment(_write(tmp_path, _default_with(plugins=[]), "without.yaml")).flat()
    changed = set(flat.splitlines()) ^ set(without.splitlines())
    assert changed and all(
        ".position_embedding" in line or line.startswith(("plugins:", "rope.")) for line in changed
    )


def test_installed_but_not_listed_changes_nothing(tmp_path):
    default = load_experiment(None)
    without = load_experiment(_write(tmp_path, _default_with(plugins=[])))
    assert without.flat() == default.flat()
    assert "rotary" not in without.flat() and not _rotary_slots(without.config)
    assert without.config.model.position_embedding.max_len == 512


def test_cli_config_shows_the_rotary_lines(tmp_path):
    path = _write(tmp_path, _default_with(plugins=["rope"], rope={"theta": 500000}))
    out = subprocess.run(
        [sys.executable, "-m", "axcore.cli", "config", path], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"{SLOT}.type: rotary" in lines and f"{SLOT}.theta: 500000.0" in lines
    assert "model.position_embedding: null" in lines


def test_scanned_experiment_gets_rotary_in_its_repeated_layer():
    exp = load_experiment("scan", ["plugins=[rope]"])
    assert exp.config.model.decoder.klass.__name__ == "RepeatedTransformer"
    _assert_rotary_everywhere(exp.config, 10000.0)
    assert [p for p, _ in _rotary_slots(exp.config)] == [SLOT]


def test_scanned_and_unrolled_rope_models_compute_the_same_logits():
    unrolled = load_experiment(None, [*TINY, "plugins=[rope]"])
    scanned = load_experiment("scan", [*TINY, "plugins=[rope]"])
    a = unrolled.config.model.instantiate(name="model", registries=unrolled.registries)
    b = scanned.config.model.instantiate(name="model", registries=scanned.registries)
    params = _random_params(a)
    layers = [params["decoder"][f"layer{i}"] for i in range(2)]
    stacked = {**params, "decoder": {"layer": jax.tree.map(lambda *x: np.stack(x), *layers)}}
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 16))

    def logits(model, p):
        return jax.jit(lambda p, x: axcore.functional(model, p, (x,), None, False, method="logits")[0])(p, ids)

    np.testing.assert_allclose(logits(a, params), logits(b, stacked), rtol=2e-5, atol=2e-5)


def test_per_layer_list_experiment_gets_one_rotary_per_layer(tmp_path):
    layer = {"self_attention": {"num_heads": 2}, "feed_forward": {"hidden_dim": 64}}
    model = {"dim": 32, "num_layers": 3, "decoder": {"layer": [layer] * 3}}
    data = {"plugins": ["rope"], "rope": {"theta": 1000}, "model": model}
    exp = load_experiment(_write(tmp_path, data))
    _assert_rotary_everywhere(exp.config, 1000.0)
    paths = [p for p, _ in _rotary_slots(exp.config)]
    assert paths == [f"model.decoder.layer[{i}].self_attention.position_embedding" for i in range(3)]
    # The copies are independent configs, not one shared object.
    assert len({id(c) for _, c in _rotary_slots(exp.config)}) == 3


def test_encoder_stack_built_from_the_layers_gets_rotary_and_runs():
    """A non-CausalLM tree: a bidirectional (causal=False) stack with a per-layer list."""
    layer = TransformerLayer.default_config()
    layer.self_attention.set(num_heads=2, causal=False)
    layer.feed_forward.hidden_dim = 32
    encoder = StackedTransformer.default_config().set(input_dim=16, num_layers=2, layer=[layer.clone(), layer.clone()])
    pm = axcore.create_plugin_manager(["rope"])
    transformed = pm.transform_config(encoder)
    _assert_rotary_everywhere(transformed, 10000.0)
    assert {c.causal for _, c in find(transformed, MultiheadAttention)} == {False}
    assert encoder.layer[0].self_attention.position_embedding is None  # Input tree untouched.

    model = transformed.instantiate(name="encoder", registries=pm.registries)
    # RoPE adds no parameters.
    plain = encoder.instantiate(name="encoder", registries=pm.registries)
    assert jax.tree.structure(model.parameter_specs()) == jax.tree.structure(plain.parameter_specs())
    params = _random_params(model)
    x = np.random.default_rng(0).normal(size=(1, 8, 16)).astype(np.float32)
    x_last = x.copy()
    x_last[:, -1] += 1.0
    batch = np.concatenate([x, x[:, ::-1], x_last])  # As is, tokens reversed, last token changed.
    out = jax.jit(lambda p, x: axcore.functional(model, p, (x,), None, False)[0])(params, batch)
    assert np.all(np.isfinite(out))
    # Without positions a bidirectional stack is permutation-equivariant; with RoPE it is not.
    assert not np.allclose(out[1], out[0][::-1], atol=1e-3)
    # Bidirectional: the first position sees a change to the last token.
    assert not np.allclose(out[2][0], out[0][0], atol=1e-4)


def test_a_model_without_attention_is_an_error():
    pm = axcore.create_plugin_manager(["rope"])
    with pytest.raises(axcore.NoMatchError, match="Plugin 'rope' found nothing to transform"):
        pm.transform_config(LearnedPositionEmbedding.default_config().set(max_len=4))


@pytest.mark.parametrize(
    "settings,error,pattern",
    [
        ({"thetta": 1}, UnknownFieldError, r"'rope\.thetta' \(did you mean 'theta'\?\)"),
        ({"rotary_fractoin": 0.5}, UnknownFieldError, r"did you mean 'rotary_fraction'"),
        ({"scaling": "yran"}, ConfigTypeError, r"'rope\.scaling' must be one of \['none', 'llama3', 'yarn'\].*'yarn'\?"),
        ({"theta": -1}, ConfigError, r"'rope\.theta' must be > 0"),
        ({"rotary_fraction": 2}, ConfigError, r"'rope\.rotary_fraction' must be in \(0, 1\]"),
    ],
)
def test_bad_settings_name_the_setting(tmp_path, settings, error, pattern):
    with pytest.raises(error, match=pattern):
        load_experiment(_write(tmp_path, {"plugins": ["rope"], "rope": settings}))


def test_odd_rotated_dims_fail_when_the_model_is_built():
    # 16 * 1/16 = 1: refused when the experiment is resolved (its model is built dry then).
    with pytest.raises(ConfigError, match=r"layer0\.self_attention\.position_embedding\.rotary_fraction.*head_dim 16"):
        load_experiment(None, [*TINY, "plugins=[rope]", "rope.rotary_fraction=0.0625"])


def test_settings_reach_every_slot_through_overrides():
    overrides = ["plugins=[rope]", "rope.scaling=llama3", "rope.scaling_factor=4", "rope.rotary_fraction=0.5"]
    exp = load_experiment(None, overrides)
    (_, rotary), = _rotary_slots(exp.config)
    assert (rotary.scaling.value, rotary.scaling_factor, rotary.rotary_fraction) == ("llama3", 4.0, 0.5)


def test_integration_hook_is_at_most_ten_lines():
    source = inspect.getsource(plugin.axcore_transform_config)
    lines = [line for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert lines[0].strip() == "@axcore.hookimpl" and lines[1].startswith("def axcore_transform_config(")
    assert len(lines) <= 10, source


def test_core_does_not_implement_or_import_rope():
    """axcore/ has no rotary code: no identifier names rope/rotary and 'rotary' appears nowhere.

    (Docstrings and messages may still use `rope` as the example plugin name.)
    """
    offenders = []
    for path in sorted((REPO / "axcore").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if re.search(r"(?i)rotary|axcore_rope", text):
            offenders.append(f"{path}: mentions rotary/axcore_rope")
        with path.open("rb") as f:
            for tok in tokenize.tokenize(f.readline):
                if tok.type != tokenize.NAME:
                    continue
                words = re.findall(r"[A-Z]+[a-z]*|[a-z]+", tok.string)
                if {w.lower() for w in words} & {"rope", "rotary"} or "RoPE" in tok.string:
                    offenders.append(f"{path}:{tok.start[0]}: identifier {tok.string}")
    assert not offenders


@pytest.mark.slow
def test_tiny_rope_model_trains(tmp_path):
    exp = load_experiment(None, [
        *TINY, "plugins=[rope]", "rope.theta=500000", "trainer.max_steps=3", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.sample.num_tokens=0", "trainer.eval_every=0", "trainer.learner.schedule.warmup_steps=1",
    ])
    assert exp.config.model.position_embedding is None
    result = Trainer(exp).run()
    assert result.step == 3 and np.isfinite(result.train_loss)
    assert "position_embedding.type: rotary" in (tmp_path / "run" / "config.txt").read_text()


class LearnedInAttention:
    """A throwaway plugin that also fills the attention slot (with a learned embedding)."""

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        learned = LearnedPositionEmbedding.default_config().set(max_len=64)
        return replace(config, MultiheadAttention, lambda _, c: c.set(position_embedding=learned.clone()))


@pytest.mark.parametrize("order", [["rope", "other"], ["other", "rope"]])
def test_another_position_embedding_plugin_conflicts(tmp_path, order):
    path = _write(tmp_path, {"plugins": order})
    first, second = order
    with pytest.raises(PluginConflictError, match=rf"Plugins '{first}' and '{second}' both set config '{SLOT}\.type'"):
        load_experiment(path, objects={"other": LearnedInAttention()})
