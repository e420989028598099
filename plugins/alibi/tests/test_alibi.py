"""The alibi plugin: slopes, the bias, attention numerics, the config transform, training."""

import jax
import numpy as np
import pytest

import axcore
from axcore.config import find, from_yaml
from axcore.experiment import load_experiment
from axcore.layers import LearnedPositionEmbedding, MultiheadAttention
from axcore.testing import TINY_OVERRIDES, train_params

from axcore_alibi import AlibiBias, alibi_slopes


def test_slopes_for_a_power_of_two_number_of_heads():
    # 2^(-8 h / n), h = 1..n.
    np.testing.assert_allclose(alibi_slopes(8), 2.0 ** (-8.0 * np.arange(1, 9) / 8), rtol=1e-12)
    np.testing.assert_allclose(alibi_slopes(8), [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    np.testing.assert_allclose(alibi_slopes(1), [2.0**-8])


def test_slopes_for_other_numbers_of_heads_interpolate():
    # n=12: the 8 slopes of n=8, then every other slope of n=16 (2^(-8 (2k+1) / 16)), first 4.
    expected = np.concatenate([2.0 ** -np.arange(1.0, 9.0), 2.0 ** (-0.5 * np.array([1.0, 3.0, 5.0, 7.0]))])
    np.testing.assert_allclose(alibi_slopes(12), expected, rtol=1e-12)
    # n=6: 2^(-2 h) for h=1..4, then 2^(-1), 2^(-3) from n=8.
    np.testing.assert_allclose(alibi_slopes(6), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3])


def _alibi(num_heads):
    registries = axcore.create_plugin_manager(["alibi"]).registries
    layer = AlibiBias.default_config().set(num_heads=num_heads, dim=8).instantiate(name="alibi", registries=registries)
    assert layer.initialize(jax.random.key(0)) == {}  # No parameters.
    return layer


def test_bias_shape_and_values():
    layer = _alibi(4)
    q_pos = np.array([[0, 1, 2], [5, 6, 7]])  # Only differences matter: batch 1 is offset.
    k_pos = np.array([[0, 1, 2, 3], [5, 6, 7, 8]])
    bias, _ = axcore.functional(layer, {}, (q_pos, k_pos), None, False, method="attention_bias")
    assert bias.shape == (2, 4, 3, 4) and bias.dtype == np.float32
    distance = np.abs(np.arange(3)[:, None] - np.arange(4)[None, :])
    expected = -alibi_slopes(4)[:, None, None] * distance
    np.testing.assert_allclose(bias[0], expected, rtol=1e-6)
    np.testing.assert_allclose(bias[1], expected, rtol=1e-6)
    # Head 0 (slope 1/4), query 2: keys 0..3 get -0.5, -0.25, 0, -0.25.
    np.testing.assert_allclose(bias[0, 0, 2], [-0.5, -0.25, 0.0, -0.25])
    # The queries and keys pass through unchanged; the input embedding is the identity.
    q = np.ones((2, 3, 4, 8), np.float32)
    (q2, _), _ = axcore.functional(layer, {}, (q, q, q_pos, q_pos), None, False, method="transform_qk")
    np.testing.assert_array_equal(q2, q)


def _np_attention_with_bias(params, x, bias, causal):
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    q, k, v = (np.einsum("btd,dnh->btnh", x, p[w]) for w in ("wq", "wk", "wv"))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias
    if causal:
        t = x.shape[1]
        logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", probs, v), p["wo"])


@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_alibi_equals_numpy_attention_with_the_bias(causal):
    pm = axcore.create_plugin_manager(["alibi"])
    cfg = from_yaml("position_embedding: {type: alibi}", pm.registries, MultiheadAttention.default_config())
    cfg.set(input_dim=32, num_heads=4, causal=causal)
    layer = cfg.instantiate(name="attn", registries=pm.registries)
    params = layer.initialize(jax.random.key(0))
    x = np.random.default_rng(1).normal(size=(2, 6, 32))
    out = jax.jit(lambda p, x: axcore.functional(layer, p, (x,), None, False)[0])(params, x.astype(np.float32))
    t = np.arange(6)
    bias = -alibi_slopes(4)[None, :, None, None] * np.abs(t[:, None] - t[None, :])
    np.testing.assert_allclose(out, _np_attention_with_bias(params, x, bias, causal), rtol=1e-5, atol=1e-5)
    # The bias matters: without it the output differs.
    assert not np.allclose(out, _np_attention_with_bias(params, x, 0.0 * bias, causal), atol=1e-3)


def test_experiment_has_alibi_in_every_attention_and_no_learned_embedding():
    exp = load_experiment(None, ["plugins=[alibi]"])
    flat = exp.flat()
    assert "model.position_embedding: null" in flat
    assert "learned_position_embedding" not in flat
    slots = [line for line in flat.splitlines() if line.endswith("self_attention.position_embedding.type: alibi")]
    assert slots == ["model.decoder.layer.self_attention.position_embedding.type: alibi"]
    assert all(a.position_embedding.klass is AlibiBias for _, a in find(exp.config, MultiheadAttention))
    assert not find(exp.config, LearnedPositionEmbedding)


def test_alibi_is_registered_only_when_enabled():
    assert "alibi" in axcore.create_plugin_manager(["alibi"]).registries.position_embeddings
    assert "alibi" not in axcore.create_plugin_manager().registries.position_embeddings


def test_three_tiny_training_steps():
    exp = load_experiment(None, ["plugins=[alibi]", *TINY_OVERRIDES])
    params, losses = train_params(exp)
    assert "position_embedding" not in params
    assert losses[-1] < losses[0]
