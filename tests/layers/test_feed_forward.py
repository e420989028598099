"""FeedForward (plain and gated) against NumPy formulas for every activation."""

import math

import jax
import numpy as np
import pytest

import axcore
from axcore.layers import Activation, FeedForward, Gating, Linear

RTOL = ATOL = 1e-5

_erf = np.vectorize(math.erf)

NP_ACTIVATIONS = {
    Activation.RELU: lambda x: np.maximum(x, 0.0),
    Activation.GELU: lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    Activation.GELU_TANH: lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    Activation.SILU: lambda x: x / (1.0 + np.exp(-x)),
}


def _ffn(activation, gating, **kw):
    cfg = FeedForward.default_config().set(input_dim=16, hidden_dim=32, activation=activation, gating=gating, **kw)
    layer = cfg.instantiate(name="ffn")
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
def test_plain_feed_forward_is_down_of_act_of_up(activation):
    layer, params = _ffn(activation, Gating.NONE)
    assert set(params) == {"up_proj", "down_proj"}
    x = _x()
    act = NP_ACTIVATIONS[activation]
    expected = act(x.astype(np.float64) @ _w(params, "up_proj")) @ _w(params, "down_proj")
    np.testing.assert_allclose(_run(layer, params, x), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("activation", list(Activation))
def test_gated_feed_forward_is_down_of_act_gate_times_up(activation):
    layer, params = _ffn(activation, Gating.GATED)
    assert set(params) == {"gate_proj", "up_proj", "down_proj"}
    x = _x(2).astype(np.float64)
    act = NP_ACTIVATIONS[activation]
    hidden = act(x @ _w(params, "gate_proj")) * (x @ _w(params, "up_proj"))
    expected = hidden @ _w(params, "down_proj")
    np.testing.assert_allclose(_run(layer, params, x.astype(np.float32)), expected, rtol=RTOL, atol=ATOL)


def test_swiglu_differs_from_plain_silu_mlp():
    gated, gp = _ffn(Activation.SILU, Gating.GATED)
    plain, pp = _ffn(Activation.SILU, Gating.NONE)
    # Same up/down weights (same names, same key), so only the gate makes a difference.
    np.testing.assert_array_equal(gp["up_proj"]["weight"], pp["up_proj"]["weight"])
    x = _x(3)
    assert not np.allclose(_run(gated, gp, x), _run(plain, pp, x), atol=1e-3)


def test_gate_and_up_projections_are_initialized_differently():
    _, params = _ffn(Activation.SILU, Gating.GATED)
    assert params["gate_proj"]["weight"].shape == params["up_proj"]["weight"].shape == (16, 32)
    assert params["down_proj"]["weight"].shape == (32, 16)
    assert not np.allclose(params["gate_proj"]["weight"], params["up_proj"]["weight"])


def test_linear_template_with_bias_adds_biases_everywhere():
    layer, params = _ffn(Activation.RELU, Gating.GATED, linear=Linear.default_config().set(bias=True))
    params = jax.tree.map(lambda p: np.asarray(p) + 0.3, params)  # Non-zero biases.
    x = _x(4).astype(np.float64)

    def lin(name, v):
        return v @ _w(params, name) + np.asarray(params[name]["bias"], np.float64)

    expected = lin("down_proj", np.maximum(lin("gate_proj", x), 0.0) * lin("up_proj", x))
    np.testing.assert_allclose(_run(layer, params, x.astype(np.float32)), expected, rtol=RTOL, atol=ATOL)


def test_projection_mesh_axes():
    layer, _ = _ffn(Activation.GELU, Gating.GATED)
    specs = layer.parameter_specs()
    assert specs["gate_proj"]["weight"].mesh_axes == ("embed", "mlp")
    assert specs["up_proj"]["weight"].mesh_axes == ("embed", "mlp")
    assert specs["down_proj"]["weight"].mesh_axes == ("mlp", "embed")


def test_activation_can_be_given_by_value_string():
    cfg = FeedForward.default_config().set(input_dim=2, hidden_dim=3, activation="silu", gating="gated")
    assert cfg.activation is Activation.SILU and cfg.gating is Gating.GATED
    with pytest.raises(axcore.ConfigError):
        cfg.set(activation="swish")
