"""The swiglu plugin: SwiGLU numerics, every FeedForward gated/silu, hidden-dim scaling, training."""

import jax
import numpy as np
import pytest

import axcore
from axcore.config import find
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.layers import Activation, CausalLM, FeedForward, Gating
from axcore_swiglu import gated_hidden_dim
from tiny import TINY, train_steps



def _transform(cfg, settings=None):
    pm = axcore.create_plugin_manager(["swiglu"])
    return pm.transform_config(cfg, pm.settings({"swiglu": settings or {}})), pm


def _np_silu(x):
    return x / (1.0 + np.exp(-x))


def test_swiglu_ffn_is_down_of_silu_gate_times_up():
    # The shapes of the tiny training model's FFN, so its initializers compile once.
    cfg, pm = _transform(FeedForward.default_config().set(input_dim=32, hidden_dim=64))
    assert cfg.gating is Gating.GATED and cfg.activation is Activation.SILU
    layer = cfg.instantiate(name="ffn", registries=pm.registries)
    params = layer.initialize(jax.random.key(0))
    assert set(params) == {"gate_proj", "up_proj", "down_proj"}
    x = 2.0 * np.random.default_rng(1).normal(size=(2, 5, 32))
    out = jax.jit(lambda p, x: axcore.functional(layer, p, (x,), None, False)[0])(params, x.astype(np.float32))
    w = {name: np.asarray(params[name]["weight"], np.float64) for name in params}
    expected = (_np_silu(x @ w["gate_proj"]) * (x @ w["up_proj"])) @ w["down_proj"]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_every_feed_forward_in_the_experiment_is_gated_silu():
    flat = load_experiment(None, ["plugins=[swiglu]"]).flat()
    gating = [line for line in flat.splitlines() if line.endswith((".gating: gated", ".gating: none"))]
    activation = [line for line in flat.splitlines() if "feed_forward.activation:" in line]
    assert gating == ["model.decoder.layer.feed_forward.gating: gated"]
    assert activation == ["model.decoder.layer.feed_forward.activation: silu"]
    assert "model.decoder.layer.feed_forward.hidden_dim: 1024" in flat  # No multiplier: unchanged.
    assert "swiglu.activation: silu" in flat and "swiglu.hidden_dim_multiplier: null" in flat


def test_nested_and_per_layer_feed_forwards_all_match():
    cfg = CausalLM.default_config().set(vocab_size=32, dim=16, num_layers=2)
    layer = cfg.decoder.layer
    layer.self_attention.num_heads = 2
    cfg.decoder.layer = [layer.clone(feed_forward=layer.feed_forward.clone(hidden_dim=h)) for h in (32, 64)]
    new, _ = _transform(cfg, {"activation": "gelu"})  # GEGLU through the same setting.
    ffns = find(new, FeedForward)
    assert [p for p, _ in ffns] == ["decoder.layer[0].feed_forward", "decoder.layer[1].feed_forward"]
    assert all(f.gating is Gating.GATED and f.activation is Activation.GELU for _, f in ffns)
    assert all(f.gating is Gating.NONE for _, f in find(cfg, FeedForward))  # Input untouched.


def test_hidden_dim_multiplier_rounds_up_to_a_multiple():
    assert gated_hidden_dim(1024, 2 / 3, 64) == 704  # LLaMA: 64 * ceil(682.67 / 64).
    assert gated_hidden_dim(96, 2 / 3, 64) == 64  # Exactly 64, not 128 from float error.
    assert gated_hidden_dim(64, 2 / 3, 8) == 48
    assert gated_hidden_dim(16, 0.1, 64) == 64  # Never zero.
    flat = load_experiment(None, ["plugins=[swiglu]", f"swiglu.hidden_dim_multiplier={2 / 3}"]).flat()
    assert "model.decoder.layer.feed_forward.hidden_dim: 704" in flat


def test_multiplier_needs_a_hidden_dim():
    with pytest.raises(ConfigError, match=r"swiglu.hidden_dim_multiplier is set but '<root>' has no hidden_dim"):
        _transform(FeedForward.default_config().set(input_dim=16), {"hidden_dim_multiplier": 0.5})


def test_three_tiny_training_steps():
    exp = load_experiment(None, ["plugins=[swiglu]", *TINY])
    params, losses = train_steps(exp)
    assert "gate_proj" in params["decoder"]["layer0"]["feed_forward"]
    assert losses[-1] < losses[0]
