"""The swiglu plugin: GatedFeedForward numerics, every FeedForward replaced, hidden-dim scaling, training."""

import jax
import numpy as np
import pytest
import yaml

import axcore
from axcore.config import find
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.layers import Activation, CausalLM, FeedForward, Linear
from axcore.testing import NP_ACTIVATIONS, TINY_OVERRIDES, train_params

from axcore_swiglu import GatedFeedForward, gated_hidden_dim

RTOL = ATOL = 1e-5


def _transform(cfg, settings=None):
    pm = axcore.create_plugin_manager(["swiglu"])
    return pm.transform_config(cfg, pm.settings({"swiglu": settings or {}})), pm


def _layer(registries, cls, activation=Activation.SILU, **kw):
    cfg = cls.default_config().set(input_dim=16, hidden_dim=32, activation=activation, **kw)
    layer = cfg.instantiate(name="ffn", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


def _x(seed, shape=(2, 5, 16)):
    # Scaled up so that every activation is exercised well away from its linear regime.
    return 2.0 * np.random.default_rng(seed).normal(size=shape)


def _run(layer, params, x):
    return axcore.functional(layer, params, (np.asarray(x, np.float32),), None, False)[0]


def _w(params):
    return {name: np.asarray(params[name]["weight"], np.float64) for name in params}


@pytest.mark.parametrize("activation", list(Activation))
def test_gated_feed_forward_is_down_of_act_gate_times_up(activation, registries):
    layer, params = _layer(registries, GatedFeedForward, activation)
    assert set(params) == {"gate_proj", "up_proj", "down_proj"}
    x, w, act = _x(2), _w(params), NP_ACTIVATIONS[activation]
    expected = (act(x @ w["gate_proj"]) * (x @ w["up_proj"])) @ w["down_proj"]
    np.testing.assert_allclose(_run(layer, params, x), expected, rtol=RTOL, atol=ATOL)


def test_linear_template_with_bias_adds_biases_everywhere(registries):
    layer, params = _layer(registries, GatedFeedForward, Activation.RELU, linear=Linear.default_config().set(bias=True))
    params = jax.tree.map(lambda p: np.asarray(p) + 0.3, params)  # Non-zero biases.
    x = _x(4)

    def lin(name, v):
        return v @ np.asarray(params[name]["weight"], np.float64) + np.asarray(params[name]["bias"], np.float64)

    expected = lin("down_proj", np.maximum(lin("gate_proj", x), 0.0) * lin("up_proj", x))
    np.testing.assert_allclose(_run(layer, params, x), expected, rtol=RTOL, atol=ATOL)


def test_projections_are_linear_layers_with_feed_forward_axes(registries):
    layer, params = _layer(registries, GatedFeedForward)
    assert all(isinstance(layer.children[n], Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    specs = layer.parameter_specs()
    assert specs["gate_proj"]["weight"].mesh_axes == specs["up_proj"]["weight"].mesh_axes == ("embed", "mlp")
    assert specs["down_proj"]["weight"].mesh_axes == ("mlp", "embed")
    assert params["gate_proj"]["weight"].shape == params["up_proj"]["weight"].shape == (16, 32)
    assert params["down_proj"]["weight"].shape == (32, 16)
    assert not np.allclose(params["gate_proj"]["weight"], params["up_proj"]["weight"])  # Keys come from names.


def test_gate_is_the_only_difference_from_the_plain_feed_forward(registries):
    gated, gp = _layer(registries, GatedFeedForward)
    plain, pp = _layer(registries, FeedForward)
    # Same names and key, so the same up/down weights: only the gate makes a difference.
    np.testing.assert_array_equal(gp["up_proj"]["weight"], pp["up_proj"]["weight"])
    np.testing.assert_array_equal(gp["down_proj"]["weight"], pp["down_proj"]["weight"])
    x = _x(3)
    assert not np.allclose(_run(gated, gp, x), _run(plain, pp, x), atol=1e-3)


def test_swiglu_ffn_is_down_of_silu_gate_times_up():
    # The shapes of the tiny training model's FFN, so its initializers compile once.
    cfg, pm = _transform(FeedForward.default_config().set(input_dim=32, hidden_dim=64))
    assert cfg.klass is GatedFeedForward and cfg.activation is Activation.SILU
    layer = cfg.instantiate(name="ffn", registries=pm.registries)
    params = layer.initialize(jax.random.key(0))
    assert set(params) == {"gate_proj", "up_proj", "down_proj"}
    x = _x(1, (2, 5, 32))
    out = jax.jit(lambda p, x: axcore.functional(layer, p, (x,), None, False)[0])(params, x.astype(np.float32))
    w = _w(params)
    silu = NP_ACTIVATIONS[Activation.SILU]
    expected = (silu(x @ w["gate_proj"]) * (x @ w["up_proj"])) @ w["down_proj"]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_transform_carries_every_field_of_the_feed_forward():
    ffn = FeedForward.default_config().set(input_dim=8, hidden_dim=24, param_dtype="bfloat16")
    ffn.linear.bias = True
    ffn.param_init.scale = 0.5
    gated, _ = _transform(ffn)
    assert gated.klass is GatedFeedForward
    assert dict(gated.items()) == dict(ffn.clone(activation="silu").items())
    assert ffn.klass is FeedForward and ffn.activation is Activation.GELU  # Input untouched.


def test_every_feed_forward_in_the_experiment_is_gated_silu():
    flat = load_experiment(None, ["plugins=[swiglu]"]).flat()
    types = [line for line in flat.splitlines() if "feed_forward.type:" in line]
    activation = [line for line in flat.splitlines() if "feed_forward.activation:" in line]
    assert types == ["model.decoder.layer.feed_forward.type: gated_feed_forward"]
    assert activation == ["model.decoder.layer.feed_forward.activation: silu"]
    assert "model.decoder.layer.feed_forward.hidden_dim: 1024" in flat  # No multiplier: unchanged.
    assert "swiglu.activation: silu" in flat and "swiglu.hidden_dim_multiplier: null" in flat


def test_nested_and_per_layer_feed_forwards_all_match():
    cfg = CausalLM.default_config().set(vocab_size=32, dim=16, num_layers=2)
    layer = cfg.decoder.layer
    layer.self_attention.num_heads = 2
    cfg.decoder.layer = [layer.clone(feed_forward=layer.feed_forward.clone(hidden_dim=h)) for h in (32, 64)]
    new, _ = _transform(cfg, {"activation": "gelu"})  # GEGLU through the same setting.
    ffns = find(new, GatedFeedForward)
    assert [p for p, _ in ffns] == ["decoder.layer[0].feed_forward", "decoder.layer[1].feed_forward"]
    assert [f.hidden_dim for _, f in ffns] == [32, 64]
    assert all(f.activation is Activation.GELU for _, f in ffns) and not find(new, FeedForward)
    assert len(find(cfg, FeedForward)) == 2 and not find(cfg, GatedFeedForward)  # Input untouched.


def test_hidden_dim_multiplier_rounds_up_to_a_multiple():
    assert gated_hidden_dim(1024, 2 / 3, 64) == 704  # LLaMA: 64 * ceil(682.67 / 64).
    assert gated_hidden_dim(96, 2 / 3, 64) == 64  # Exactly 64, not 128 from float error.
    assert gated_hidden_dim(64, 2 / 3, 8) == 48
    assert gated_hidden_dim(16, 0.1, 64) == 64  # Never zero.
    flat = load_experiment(None, ["plugins=[swiglu]", f"swiglu.hidden_dim_multiplier={2 / 3}"]).flat()
    assert "model.decoder.layer.feed_forward.hidden_dim: 704" in flat


def test_a_saved_resolved_config_reads_back_unchanged(tmp_path):
    # The transform runs again on a config read back; it must not scale hidden_dim twice.
    exp = load_experiment(None, ["plugins=[swiglu]", f"swiglu.hidden_dim_multiplier={2 / 3}"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({k: v for k, v in exp.to_dict().items() if k != "mesh"}, sort_keys=False))
    assert load_experiment(saved).flat() == exp.flat()


def test_multiplier_needs_a_hidden_dim():
    with pytest.raises(ConfigError, match=r"swiglu.hidden_dim_multiplier is set but '<root>' has no hidden_dim"):
        _transform(FeedForward.default_config().set(input_dim=16), {"hidden_dim_multiplier": 0.5})


def test_three_tiny_training_steps():
    exp = load_experiment(None, ["plugins=[swiglu]", *TINY_OVERRIDES])
    params, losses = train_params(exp)
    assert set(params["decoder"]["layer0"]["feed_forward"]) == {"gate_proj", "up_proj", "down_proj"}
    assert losses[-1] < losses[0]
