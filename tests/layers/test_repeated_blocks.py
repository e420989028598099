"""RepeatedTransformer with a block of layers as its unit, and with rematerialization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.errors import ConfigError
from axcore.layers import RepeatedTransformer, StackedTransformer, TransformerLayer


def _layer(hidden):
    cfg = TransformerLayer.default_config()
    cfg.self_attention.set(num_heads=2, causal=True)
    cfg.feed_forward.hidden_dim = hidden
    return cfg


def _stack(n, hiddens):
    return StackedTransformer.default_config().set(num_layers=n, layer=[_layer(h) for h in hiddens])


def test_block_unit_equals_the_unrolled_sequence(registries):
    # Four layers alternating hidden sizes 16, 32: a scan over two blocks of [16, 32].
    unrolled = _stack(4, [16, 32, 16, 32]).set(input_dim=8).instantiate(name="s", registries=registries)
    repeated = RepeatedTransformer.default_config().set(input_dim=8, num_layers=4, layer=_stack(2, [16, 32]))
    repeated = repeated.instantiate(name="r", registries=registries)
    assert repeated.repeats == 2 and repeated.layers_per_unit == 2
    params = unrolled.initialize(jax.random.key(0))
    stacked = {
        "layer": {
            "layer0": jax.tree.map(lambda a, b: jnp.stack([a, b]), params["layer0"], params["layer2"]),
            "layer1": jax.tree.map(lambda a, b: jnp.stack([a, b]), params["layer1"], params["layer3"]),
        }
    }
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(lambda a: a.shape, repeated.abstract_parameters())
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    expected, _ = axcore.functional(unrolled, params, (x,), None, False)
    actual, _ = axcore.functional(repeated, stacked, (x,), None, False)
    np.testing.assert_allclose(actual, expected, atol=1e-5)


def test_remat_policy_keeps_gradients(registries):
    base = RepeatedTransformer.default_config().set(input_dim=8, num_layers=3, layer=_layer(16))
    plain = base.instantiate(name="r", registries=registries)
    remat = base.clone(remat_policy="nothing_saveable").instantiate(name="r", registries=registries)
    params = plain.initialize(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))

    def grads(model):
        return jax.grad(lambda p: jnp.sum(axcore.functional(model, p, (x,), None, False)[0] ** 2))(params)

    for a, b in zip(jax.tree.leaves(grads(plain)), jax.tree.leaves(grads(remat))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bad_block_and_policy_are_config_errors(registries):
    with pytest.raises(ConfigError, match="not a multiple"):
        cfg = RepeatedTransformer.default_config().set(input_dim=8, num_layers=3, layer=_stack(2, [16, 32]))
        cfg.instantiate(name="r", registries=registries)
    with pytest.raises(ConfigError, match="remat_policy 'nothing'"):
        cfg = RepeatedTransformer.default_config().set(
            input_dim=8, num_layers=2, layer=_layer(16), remat_policy="nothing"
        )
        cfg.instantiate(name="r", registries=registries)
