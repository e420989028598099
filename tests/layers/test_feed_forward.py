"""FeedForward `down(act(up(x)))` against NumPy formulas for every activation."""

import jax
import numpy as np
import pytest

import axcore
from axcore.layers import Activation, FeedForward, Linear
from axcore.testing import NP_ACTIVATIONS

RTOL = ATOL = 1e-5


def _ffn(registries, activation, **kw):
    cfg = FeedForward.default_config().set(input_dim=16, hidden_dim=32, activation=activation, **kw)
    layer = cfg.instantiate(name="ffn", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


def _x(seed=1):
    # Scaled up so that every activation is exercised well away from its linear regime.
    return (2.0 * np.random.default_rng(seed).normal(size=(2, 5, 16))).astype(np.float32)


def _run(layer, params, x):
    out, _ = axcore.functional(layer, params, inputs=(x,), prng_key=None, is_training=False)
    return out


def _w(params, name):
    return np.asarray(params[name]["weight"], np.float64)


@pytest.mark.parametrize("activation", list(Activation))
def test_feed_forward_is_down_of_act_of_up(activation, registries):
    layer, params = _ffn(registries, activation)
    assert set(params) == {"up_proj", "down_proj"}
    x = _x()
    act = NP_ACTIVATIONS[activation]
    expected = act(x.astype(np.float64) @ _w(params, "up_proj")) @ _w(params, "down_proj")
    np.testing.assert_allclose(_run(layer, params, x), expected, rtol=RTOL, atol=ATOL)


def test_linear_template_with_bias_adds_biases_to_both_projections(registries):
    layer, params = _ffn(registries, Activation.RELU, linear=Linear.default_config().set(bias=True))
    params = jax.tree.map(lambda p: np.asarray(p) + 0.3, params)  # Non-zero biases.
    x = _x(4).astype(np.float64)

    def lin(name, v):
        return v @ _w(params, name) + np.asarray(params[name]["bias"], np.float64)

    expected = lin("down_proj", np.maximum(lin("up_proj", x), 0.0))
    np.testing.assert_allclose(_run(layer, params, x.astype(np.float32)), expected, rtol=RTOL, atol=ATOL)


def test_projection_shapes_and_mesh_axes(registries):
    layer, _ = _ffn(registries, Activation.GELU)
    specs = layer.parameter_specs()
    assert set(specs) == {"up_proj", "down_proj"}
    assert specs["up_proj"]["weight"].shape == (16, 32) and specs["up_proj"]["weight"].mesh_axes == ("embed", "mlp")
    assert specs["down_proj"]["weight"].shape == (32, 16) and specs["down_proj"]["weight"].mesh_axes == ("mlp", "embed")


def test_activation_can_be_given_by_value_string():
    cfg = FeedForward.default_config().set(input_dim=2, hidden_dim=3, activation="silu")
    assert cfg.activation is Activation.SILU
    with pytest.raises(axcore.ConfigError):
        cfg.set(activation="swish")


def test_the_core_feed_forward_has_no_gating():
    # Gating (SwiGLU, GEGLU) lives in the axcore-swiglu plugin's own layer.
    assert "gating" not in FeedForward.default_config().keys()
    with pytest.raises(axcore.ConfigError, match="gating"):
        FeedForward.default_config().set(gating="gated")
