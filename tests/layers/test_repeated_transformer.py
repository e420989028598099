"""RepeatedTransformer (scan over stacked params) versus the unrolled StackedTransformer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.layers import RepeatedTransformer, StackedTransformer, TransformerLayer
from axcore.module import Module

DIM, HEADS, HIDDEN, NUM_LAYERS = 16, 4, 32, 3


def _layer_cfg(dropout_rate=0.0):
    cfg = TransformerLayer.default_config().set(input_dim=DIM, dropout_rate=dropout_rate)
    cfg.self_attention.set(num_heads=HEADS, causal=True)
    cfg.feed_forward.hidden_dim = HIDDEN
    return cfg


def _pair(layer_cfg=None):
    layer_cfg = layer_cfg or _layer_cfg()
    stacked = StackedTransformer.default_config().set(input_dim=DIM, num_layers=NUM_LAYERS, layer=layer_cfg)
    repeated = RepeatedTransformer.default_config().set(input_dim=DIM, num_layers=NUM_LAYERS, layer=layer_cfg)
    return stacked.instantiate(name="stack"), repeated.instantiate(name="stack")


def _stack_params(unrolled):
    layers = [unrolled[f"layer{i}"] for i in range(NUM_LAYERS)]
    return {"layer": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def _x(seed=1):
    return np.random.default_rng(seed).normal(size=(2, 6, DIM)).astype(np.float32)


def _run(layer, params, inputs, **kw):
    kw.setdefault("prng_key", None)
    kw.setdefault("is_training", False)
    out, collection = axcore.functional(layer, params, inputs=inputs, **kw)
    return out, collection


def test_repeated_equals_stacked_for_the_same_params():
    stacked, repeated = _pair()
    unrolled = stacked.initialize(jax.random.key(0))
    x = _x()
    kv_mask = np.array([[True] * 6, [True] * 4 + [False] * 2])
    inputs = {"x": x, "kv_mask": kv_mask}
    a, _ = _run(stacked, unrolled, inputs)
    b, _ = _run(repeated, _stack_params(unrolled), inputs)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Layers are not interchangeable: reversing the stacking order changes the output.
    reversed_params = {f"layer{i}": unrolled[f"layer{NUM_LAYERS - 1 - i}"] for i in range(NUM_LAYERS)}
    c, _ = _run(repeated, _stack_params(reversed_params), inputs)
    assert not np.allclose(b, c, atol=1e-3)


def test_repeated_parameter_specs_have_leading_layer_axis():
    stacked, repeated = _pair()
    specs = repeated.parameter_specs()
    assert set(specs) == {"layer"}
    unrolled_specs = stacked.parameter_specs()["layer0"]
    flat_r = jax.tree_util.tree_leaves_with_path(specs["layer"])
    flat_u = jax.tree_util.tree_leaves_with_path(unrolled_specs)
    assert [p for p, _ in flat_r] == [p for p, _ in flat_u]
    for (path, r), (_, u) in zip(flat_r, flat_u):
        assert r.shape == (NUM_LAYERS, *u.shape), path
        assert r.mesh_axes == ("layers", *u.mesh_axes), path
        assert r.dtype == u.dtype
        assert r.weight_decay_scale == u.weight_decay_scale
    assert specs["layer"]["self_attention"]["wq"].mesh_axes == ("layers", "embed", "heads", None)


def test_repeated_initialize_matches_abstract_and_layers_differ():
    _, repeated = _pair()
    params = repeated.initialize(jax.random.key(0))
    abstract = repeated.abstract_parameters()
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    wq = np.asarray(params["layer"]["self_attention"]["wq"])
    assert not np.allclose(wq[0], wq[1]) and not np.allclose(wq[1], wq[2])
    # Every layer slice has the initializer's statistics (std 1/sqrt(DIM) for fan_in).
    for i in range(NUM_LAYERS):
        assert 0.15 < wq[i].std() < 0.35
    np.testing.assert_array_equal(params["layer"]["attention_norm"]["scale"], np.ones((NUM_LAYERS, DIM)))


def test_repeated_gradients_equal_stacked_gradients():
    stacked, repeated = _pair()
    unrolled = stacked.initialize(jax.random.key(2))
    x = _x(3)

    def loss(module, params):
        out, _ = _run(module, params, (x,))
        return jnp.sum(out)

    g_unrolled = jax.grad(lambda p: loss(stacked, p))(unrolled)
    g_repeated = jax.grad(lambda p: loss(repeated, p))(_stack_params(unrolled))
    expected = _stack_params(g_unrolled)
    assert jax.tree.structure(expected) == jax.tree.structure(g_repeated)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(g_repeated)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(g_repeated["layer"]["self_attention"]["wq"])).max() > 1e-3


def test_repeated_transformer_works_under_jit():
    _, repeated = _pair()
    params = repeated.initialize(jax.random.key(0))
    x = _x()
    eager, _ = _run(repeated, params, (x,))
    jitted = jax.jit(lambda p, x: _run(repeated, p, (x,))[0])(params, x)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-5)


def test_repeated_dropout_differs_per_layer_and_is_deterministic():
    _, repeated = _pair(_layer_cfg(dropout_rate=0.5))
    params = repeated.initialize(jax.random.key(0))
    x = _x()
    ev, _ = _run(repeated, params, (x,))
    a, _ = _run(repeated, params, (x,), prng_key=jax.random.key(5), is_training=True)
    b, _ = _run(repeated, params, (x,), prng_key=jax.random.key(5), is_training=True)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, ev, atol=1e-3)


class _RecordingLayer(Module):
    """Adds 1 and records the layer's input mean as an output."""

    class Config(Module.Config):
        input_dim: int = 0

    def forward(self, x, **kwargs):
        self.add_module_output("aux_loss", jnp.mean(x))
        self.add_summary("x_mean", jnp.mean(x))
        return x + 1.0


@pytest.mark.parametrize("cls", [StackedTransformer, RepeatedTransformer])
def test_layer_outputs_are_collected_per_layer(cls):
    cfg = cls.default_config().set(input_dim=DIM, num_layers=NUM_LAYERS, layer=_RecordingLayer.default_config())
    stack = cfg.instantiate(name="stack")
    x = np.zeros((1, 2, DIM), np.float32)
    out, collection = _run(stack, {}, (x,))
    np.testing.assert_allclose(out, x + NUM_LAYERS)
    if cls is RepeatedTransformer:
        np.testing.assert_allclose(collection.module_outputs["layer"]["aux_loss"], [0.0, 1.0, 2.0])
        np.testing.assert_allclose(collection.summaries["layer"]["x_mean"], [0.0, 1.0, 2.0])
    else:
        got = [float(collection.module_outputs[f"layer{i}"]["aux_loss"]) for i in range(NUM_LAYERS)]
        assert got == [0.0, 1.0, 2.0]
