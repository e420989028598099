"""Module tree, invocation contexts and functional()."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import REQUIRED
from axcore.layers import StackedTransformer
from axcore.module import InvocationError, current_context
from axcore.params import FanAxes, ParameterSpec, ParamInit, constant


class Scale(axcore.Module):
    """y = x * w; records the key it saw and a summary."""

    class Config(axcore.Module.Config):
        # Feature dimension.
        dim: int = REQUIRED

    def _create_parameter_specs(self):
        init = ParamInit().initializer(FanAxes((0,), (0,)))
        return {"w": ParameterSpec((self._config.dim,), jnp.float32, init, ("embed",))}

    def forward(self, x):
        self.add_summary("mean", jnp.mean(x))
        if self.prng_key is not None:
            self.add_module_output("key", jax.random.key_data(self.prng_key))
        if self.is_training:
            self.add_state_update("seen", jnp.ones(()))
        return x * self.parameters["w"]

    def _call(self, fn):
        """Runs `fn` inside this module's context (used to call a sibling)."""
        return fn()


class Pair(axcore.Module):
    """y = b(a(x)) + bias; optionally calls `extra` first."""

    class Config(axcore.Module.Config):
        # Feature dimension.
        dim: int = REQUIRED
        # Whether to add and call a third child before the others.
        with_extra: bool = False

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        child = Scale.default_config().set(dim=self._config.dim)
        if self._config.with_extra:
            self._add_child("extra", child)
        self._add_child("a", child)
        self._add_child("b", child)

    def _create_parameter_specs(self):
        return {"bias": ParameterSpec((self._config.dim,), jnp.float32, constant(0.5), ("embed",), 0.0)}

    def forward(self, x):
        if self._config.with_extra:
            self.extra(x)
        return self.b(self.a(x)) + self.parameters["bias"]


def _build(dim=3, **kw):
    return Pair.default_config().set(dim=dim, **kw).instantiate(name="pair")


def _fold(key, name):
    return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def test_functional_computes_with_explicit_state():
    model = _build()
    params = {"a": {"w": jnp.array([1.0, 2, 3])}, "b": {"w": jnp.array([2.0, 2, 2])}, "bias": jnp.ones(3)}
    out, _ = axcore.functional(model, params, (jnp.ones(3),), jax.random.key(0), False)
    np.testing.assert_allclose(out, [3.0, 5.0, 7.0])


def test_child_key_is_folded_from_its_name_not_call_order():
    root = jax.random.key(42)
    params = _build().initialize(jax.random.key(0))
    _, plain = axcore.functional(_build(), params, (jnp.ones(3),), root, True)
    extra_model = _build(with_extra=True)
    extra_params = dict(params, extra=params["a"])
    _, extra = axcore.functional(extra_model, extra_params, (jnp.ones(3),), root, True)
    expected_a = jax.random.key_data(_fold(root, "a"))
    np.testing.assert_array_equal(plain.module_outputs["a"]["key"], expected_a)
    np.testing.assert_array_equal(extra.module_outputs["a"]["key"], expected_a)
    assert not np.array_equal(plain.module_outputs["a"]["key"], plain.module_outputs["b"]["key"])


def test_output_collection_nests_by_child_name():
    model = _build()
    params = model.initialize(jax.random.key(0))
    x = jnp.arange(3.0)
    _, coll = axcore.functional(model, params, (x,), jax.random.key(1), is_training=True)
    np.testing.assert_allclose(coll.summaries["a"]["mean"], 1.0)
    assert set(coll.summaries) == {"a", "b"}
    assert coll.state_updates == {"a": {"seen": 1.0}, "b": {"seen": 1.0}}
    _, coll = axcore.functional(model, params, (x,), jax.random.key(1), is_training=False)
    assert coll.state_updates == {}  # Training flag reached the children.


def test_initialize_folds_keys_from_parameter_paths():
    model = _build()
    key = jax.random.key(7)
    params = model.initialize(key)
    expected = jax.random.normal(_fold(key, "b/w"), (3,)) / np.sqrt(3)
    np.testing.assert_allclose(params["b"]["w"], expected, rtol=1e-6)
    np.testing.assert_allclose(params["bias"], 0.5)
    # Adding a sibling does not change existing parameters.
    with_extra = _build(with_extra=True).initialize(key)
    np.testing.assert_array_equal(with_extra["b"]["w"], params["b"]["w"])


@pytest.mark.parametrize("group_bytes", [None, 1])  # One batched draw per shape; one draw per parameter.
def test_batched_initialize_matches_separate_draws_bit_for_bit(monkeypatch, group_bytes, registries):
    if group_bytes is not None:
        monkeypatch.setattr(axcore.module, "_GROUP_BYTES", group_bytes)
    cfg = StackedTransformer.default_config().set(num_layers=3, input_dim=16)
    cfg.layer.self_attention.set(num_heads=2)
    cfg.layer.feed_forward.hidden_dim = 32
    model = cfg.instantiate(name="stack", registries=registries)
    key = jax.random.key(3)
    params = model.initialize(key)
    flat_specs = jax.tree_util.tree_flatten_with_path(model.parameter_specs())[0]
    assert len(flat_specs) > 10
    for path, spec in flat_specs:  # Each leaf drawn on its own (jitted, as XLA fuses it) from its path's key.
        name = "/".join(str(entry.key) for entry in path)
        expected = jax.jit(spec.initializer, static_argnums=(1, 2))(_fold(key, name), spec.shape, spec.dtype)
        actual = params
        for entry in path:
            actual = actual[entry.key]
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=name)


def test_a_root_without_registries_raises_once_a_layer_needs_a_kernel(registries):
    cfg = StackedTransformer.default_config().set(num_layers=1, input_dim=16)
    cfg.layer.self_attention.set(num_heads=2)
    cfg.layer.feed_forward.hidden_dim = 32
    # No silent fallback to built-in registries: a layer that needs a kernel raises.
    model = cfg.instantiate(name="stack")
    with pytest.raises(InvocationError, match="registries"):
        model.parameter_specs()
    # Children reach the root's registries.
    model = cfg.instantiate(name="stack", registries=registries)
    assert model.layer0.self_attention.registries is registries
    model.parameter_specs()


def test_parameter_specs_allocate_nothing():
    specs = _build(dim=1 << 20).parameter_specs()
    leaves = jax.tree.leaves(specs)
    assert all(isinstance(leaf, ParameterSpec) for leaf in leaves)
    assert specs["a"]["w"].shape == (1 << 20,) and specs["bias"].weight_decay_scale == 0.0
    abstract = _build(dim=5).abstract_parameters()
    assert abstract["b"]["w"] == jax.ShapeDtypeStruct((5,), jnp.float32)
    concrete = _build(dim=5).initialize(jax.random.key(0))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), concrete) == jax.tree.map(
        lambda s: (s.shape, s.dtype), abstract
    )


def _loss(model, params, x, key):
    out, _ = axcore.functional(model, params, (x,), key, True)
    return jnp.sum(out**2)


def test_jit_and_grad():
    model = _build()
    params = model.initialize(jax.random.key(0))
    x = jnp.array([1.0, -2.0, 3.0])
    grads = jax.jit(jax.grad(lambda p: _loss(model, p, x, jax.random.key(1))))(params)
    wa, wb, bias = params["a"]["w"], params["b"]["w"], params["bias"]
    y = x * wa * wb + bias
    np.testing.assert_allclose(grads["bias"], 2 * y, rtol=1e-5)
    np.testing.assert_allclose(grads["a"]["w"], 2 * y * x * wb, rtol=1e-5)


def test_vmap_over_inputs():
    model = _build()
    params = model.initialize(jax.random.key(0))
    xs = jnp.arange(12.0).reshape(4, 3)
    fn = lambda x: axcore.functional(model, params, (x,), None, False)[0]  # noqa: E731
    expected = xs * params["a"]["w"] * params["b"]["w"] + params["bias"]
    np.testing.assert_allclose(jax.vmap(fn)(xs), expected, rtol=1e-6)


def test_scan_over_steps():
    model = _build()
    params = model.initialize(jax.random.key(0))

    def body(x, key):
        out, coll = axcore.functional(model, params, (x,), key, False)
        return out, coll.summaries["a"]["mean"]

    final, means = jax.lax.scan(body, jnp.ones(3), jax.random.split(jax.random.key(0), 3))
    x = jnp.ones(3)
    expected_means = []
    for _ in range(3):
        expected_means.append(jnp.mean(x))
        x = x * params["a"]["w"] * params["b"]["w"] + params["bias"]
    np.testing.assert_allclose(final, x, rtol=1e-5)
    np.testing.assert_allclose(means, expected_means, rtol=1e-5)


def test_calls_outside_a_context_are_errors():
    model = _build()
    with pytest.raises(InvocationError, match="functional"):
        model.forward(jnp.ones(3))
    with pytest.raises(InvocationError):
        model.a.forward(jnp.ones(3))
    assert current_context() is None


def test_only_ancestors_may_call_a_module():
    model = _build()
    params = model.initialize(jax.random.key(0))
    with pytest.raises(InvocationError, match="not one of its ancestors"):
        axcore.functional(model.a, params["a"], (lambda: model.b(jnp.ones(3)),), None, False, method="_call")


def test_context_is_restored_after_an_exception():
    model = _build()
    with pytest.raises(KeyError):  # No parameters given.
        axcore.functional(model, {}, (jnp.ones(3),), None, False)
    assert current_context() is None


def test_module_paths_and_children():
    model = _build()
    assert model.a.path == "pair.a" and model.a.parent is model
    assert list(model.children) == ["a", "b"]
    with pytest.raises(AttributeError, match="no attribute or child 'c'"):
        _ = model.c
