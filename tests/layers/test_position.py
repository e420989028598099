"""LearnedPositionEmbedding and the identity defaults of PositionEmbedding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.layers import LearnedPositionEmbedding, PositionEmbedding


def _learned(registries, max_len=2048, dim=16):
    # (2048, 16) is also the CausalLM tests' table: its initializer compiles once.
    cfg = LearnedPositionEmbedding.default_config().set(max_len=max_len, dim=dim)
    layer = cfg.instantiate(name="pos", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


def _embed(layer, params, x, positions):
    out, _ = axcore.functional(
        layer, params, inputs=(x, positions), prng_key=None, is_training=False, method="embed_inputs"
    )
    return out


def _x(shape=(2, 5, 16), seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_learned_table_shape_and_axes(registries):
    layer, params = _learned(registries)
    assert params["weight"].shape == (2048, 16)
    assert layer.parameter_specs()["weight"].mesh_axes == (None, "embed")
    assert np.std(params["weight"]) > 0.05  # Random, not zeros.


def test_embed_inputs_adds_table_rows_at_default_positions(registries):
    layer, params = _learned(registries)
    x = _x()
    positions = np.broadcast_to(np.arange(5), (2, 5))
    table = np.asarray(params["weight"], np.float64)
    expected = x.astype(np.float64) + table[:5][None]
    np.testing.assert_allclose(_embed(layer, params, x, positions), expected, rtol=1e-6, atol=1e-6)


def test_embed_inputs_uses_the_given_positions_per_example(registries):
    layer, params = _learned(registries)
    x = _x()
    positions = np.array([[7, 0, 3, 3, 1], [2, 2047, 6, 5, 0]])
    table = np.asarray(params["weight"], np.float64)
    expected = x.astype(np.float64) + table[positions]
    np.testing.assert_allclose(_embed(layer, params, x, positions), expected, rtol=1e-6, atol=1e-6)


def test_sequence_at_max_len_is_fine_and_longer_raises(registries):
    layer, params = _learned(registries)
    x = _x((1, 2048, 16))
    out = _embed(layer, params, x, np.arange(2048)[None])
    np.testing.assert_allclose(out, x + np.asarray(params["weight"])[None], rtol=1e-6, atol=1e-6)
    x_long = np.zeros((1, 2049, 16), np.float32)
    with pytest.raises(ValueError, match="max_len"):
        _embed(layer, params, x_long, np.arange(2049)[None])


def test_unset_dim_raises_when_specs_are_built(registries):
    layer = LearnedPositionEmbedding.default_config().set(max_len=4).instantiate(name="pos", registries=registries)
    with pytest.raises(ValueError, match="dim"):
        layer.parameter_specs()


def test_embed_inputs_gradient_flows_only_to_used_rows(registries):
    layer, params = _learned(registries)
    x = _x((1, 3, 16))
    positions = np.array([[1, 4, 4]])

    def loss(p):
        return jnp.sum(_embed(layer, p, x, positions))

    grad = np.asarray(jax.grad(loss)(params)["weight"])
    expected = np.zeros((2048, 16))
    expected[1] = 1.0
    expected[4] = 2.0
    np.testing.assert_allclose(grad, expected)


def test_base_position_embedding_is_identity_everywhere(registries):
    layer = PositionEmbedding.default_config().instantiate(name="pos", registries=registries)
    assert layer.parameter_specs() == {}
    x, q, k = _x((1, 3, 4)), _x((1, 3, 2, 4), 2), _x((1, 3, 1, 4), 3)
    pos = np.arange(3)[None]
    out, _ = axcore.functional(layer, {}, (x, pos), None, False, method="embed_inputs")
    np.testing.assert_array_equal(out, x)
    (q2, k2), _ = axcore.functional(layer, {}, (q, k, pos, pos), None, False, method="transform_qk")
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(k2, k)
    bias, _ = axcore.functional(layer, {}, (pos, pos), None, False, method="attention_bias")
    assert bias is None
    slopes, _ = axcore.functional(layer, {}, (), None, False, method="bias_slopes")
    assert slopes is None
