"""RepeatedTransformer (scan over stacked params) versus the unrolled StackedTransformer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.layers import BaseLayer, Linear, RepeatedTransformer, StackedTransformer, TransformerLayer
from axcore.module import Module
from axcore.params import ParameterSpec, constant

DIM, HEADS, HIDDEN, NUM_LAYERS = 16, 4, 32, 2


def _layer_cfg():
    cfg = TransformerLayer.default_config().set(input_dim=DIM)
    cfg.self_attention.set(num_heads=HEADS, causal=True)
    cfg.feed_forward.hidden_dim = HIDDEN
    return cfg


def _pair(registries, unroll=1):
    layer_cfg = _layer_cfg()
    stacked = StackedTransformer.default_config().set(input_dim=DIM, num_layers=NUM_LAYERS, layer=layer_cfg)
    repeated = RepeatedTransformer.default_config().set(
        input_dim=DIM, num_layers=NUM_LAYERS, layer=layer_cfg, unroll=unroll
    )
    return (
        stacked.instantiate(name="stack", registries=registries),
        repeated.instantiate(name="stack", registries=registries),
    )


def _stack_params(unrolled):
    layers = [unrolled[f"layer{i}"] for i in range(NUM_LAYERS)]
    # np.stack (same result as jnp.stack) avoids compiling a stack op per shape.
    return {"layer": jax.tree.map(lambda *xs: np.stack([np.asarray(a) for a in xs]), *layers)}


def _x(seed=1):
    return np.random.default_rng(seed).normal(size=(2, 6, DIM)).astype(np.float32)


def _run(layer, params, inputs, **kw):
    kw.setdefault("prng_key", None)
    kw.setdefault("is_training", False)
    out, collection = axcore.functional(layer, params, inputs=inputs, **kw)
    return out, collection


def test_repeated_equals_stacked_for_the_same_params_under_jit(registries):
    stacked, repeated = _pair(registries)
    unrolled = stacked.initialize(jax.random.key(0))
    x = _x()
    kv_mask = np.array([[True] * 6, [True] * 4 + [False] * 2])
    inputs = {"x": x, "kv_mask": kv_mask}
    a, _ = _run(stacked, unrolled, inputs)
    # The scan also runs eagerly (see the LM and output-collection tests); here it is jitted.
    b = jax.jit(lambda p, inputs: _run(repeated, p, inputs)[0])(_stack_params(unrolled), inputs)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.allclose(a, x, atol=0.1)  # The layers do something.


def test_repeated_parameter_specs_have_leading_layer_axis(registries):
    stacked, repeated = _pair(registries)
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


def test_repeated_initialize_draws_each_layer_independently_and_scans_in_order(registries):
    # A Linear as the repeated layer keeps this cheap; stacking is the same for any layer.
    cfg = RepeatedTransformer.default_config().set(
        input_dim=DIM, num_layers=3, layer=Linear.default_config().set(output_dim=DIM)
    )
    repeated = cfg.instantiate(name="stack", registries=registries)
    params = repeated.initialize(jax.random.key(0))
    abstract = repeated.abstract_parameters()
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    w = np.asarray(params["layer"]["weight"], np.float64)
    assert w.shape == (3, DIM, DIM)
    assert not np.allclose(w[0], w[1]) and not np.allclose(w[1], w[2])
    for i in range(3):  # Every slice has the initializer's std 1/sqrt(fan_in).
        assert 0.15 < w[i].std() < 0.35
    np.testing.assert_array_equal(params["layer"]["bias"], np.zeros((3, DIM)))
    bias = np.random.default_rng(0).normal(size=(3, DIM))
    params = {"layer": {"weight": params["layer"]["weight"], "bias": bias.astype(np.float32)}}
    x = _x()
    expected = x.astype(np.float64)
    for i in range(3):
        expected = expected @ w[i] + bias[i]
    out, _ = _run(repeated, params, (x,))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unroll", [1, 2, 5])  # 5 > repeats: fully unrolled.
def test_repeated_gradients_equal_stacked_gradients(unroll, registries):
    stacked, repeated = _pair(registries, unroll)
    unrolled = stacked.initialize(jax.random.key(2))
    x = _x(3)

    def loss(module, params):
        out, _ = _run(module, params, (x,))
        return jnp.sum(out)

    g_unrolled = jax.jit(jax.grad(lambda p: loss(stacked, p)))(unrolled)
    g_repeated = jax.jit(jax.grad(lambda p: loss(repeated, p)))(_stack_params(unrolled))
    expected = _stack_params(g_unrolled)
    assert jax.tree.structure(expected) == jax.tree.structure(g_repeated)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(g_repeated)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(g_repeated["layer"]["self_attention"]["wq"])).max() > 1e-3


def test_unroll_below_one_is_rejected_with_the_path(registries):
    with pytest.raises(axcore.ConfigError, match="stack: unroll must be >= 1"):
        _pair(registries, unroll=0)


class _RecordingLayer(BaseLayer):
    """Adds its bias and records the mean of its input as an aux loss and a summary."""

    def _create_parameter_specs(self):
        return {"bias": ParameterSpec((DIM,), jnp.float32, constant(1.0), (None,), 0.0)}

    def forward(self, x, **kwargs):
        self.add_module_output("aux_loss", jnp.mean(x))
        self.add_summary("x_mean", jnp.mean(x))
        return x + self.parameters["bias"]


class _ParameterlessLayer(Module):
    """Adds 1; has no parameters."""

    def forward(self, x, **kwargs):
        return x + 1.0


@pytest.mark.parametrize("cls", [StackedTransformer, RepeatedTransformer])
def test_layer_outputs_are_collected_per_layer(cls, registries):
    cfg = cls.default_config().set(input_dim=DIM, num_layers=NUM_LAYERS, layer=_RecordingLayer.default_config())
    stack = cfg.instantiate(name="stack", registries=registries)
    params = stack.initialize(jax.random.key(0))
    x = np.zeros((1, 2, DIM), np.float32)
    out, collection = _run(stack, params, (x,))
    np.testing.assert_allclose(out, x + NUM_LAYERS)
    if cls is RepeatedTransformer:
        assert params["layer"]["bias"].shape == (NUM_LAYERS, DIM)
        np.testing.assert_allclose(collection.module_outputs["layer"]["aux_loss"], list(range(NUM_LAYERS)))
        np.testing.assert_allclose(collection.summaries["layer"]["x_mean"], list(range(NUM_LAYERS)))
    else:
        got = [float(collection.module_outputs[f"layer{i}"]["aux_loss"]) for i in range(NUM_LAYERS)]
        assert got == list(range(NUM_LAYERS))


@pytest.mark.parametrize("cls", [StackedTransformer, RepeatedTransformer])
def test_parameterless_layer_is_applied_num_layers_times(cls, registries):
    # Without parameters and without a PRNG key there is nothing for scan to iterate
    # over, so the number of repetitions must come from num_layers.
    cfg = cls.default_config().set(input_dim=DIM, num_layers=NUM_LAYERS, layer=_ParameterlessLayer.default_config())
    stack = cfg.instantiate(name="stack", registries=registries)
    x = np.zeros((1, 2, DIM), np.float32)
    out, _ = _run(stack, {}, (x,))
    np.testing.assert_allclose(out, x + NUM_LAYERS)
