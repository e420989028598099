"""Linear, Embedding, RMSNorm and LayerNorm against NumPy formulas; parameter specs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.errors import ConfigError
from axcore.layers import Embedding, LayerNorm, Linear, RMSNorm

RTOL = ATOL = 1e-5


def _run(layer, params, inputs, method="forward"):
    out, _ = axcore.functional(layer, params, inputs=inputs, prng_key=None, is_training=False, method=method)
    return out


def _perturb(params, seed):
    """Adds noise to every parameter (so constant-initialized biases and scales matter)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: (np.asarray(p) + 0.5 * rng.normal(size=p.shape)).astype(np.float32), params)


def _x(shape, seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# -- Linear ------------------------------------------------------------------------------


def test_linear_with_bias_matches_numpy_affine_map(registries):
    layer = Linear.default_config().set(input_dim=16, output_dim=32).instantiate(name="layer", registries=registries)
    params = _perturb(layer.initialize(jax.random.key(0)), seed=1)
    assert set(params) == {"weight", "bias"}
    x = _x((2, 5, 16))
    w, b = np.asarray(params["weight"], np.float64), np.asarray(params["bias"], np.float64)
    expected = x.astype(np.float64) @ w + b
    np.testing.assert_allclose(_run(layer, params, (x,)), expected, rtol=RTOL, atol=ATOL)


def test_linear_without_bias_has_no_bias_param_and_is_linear(registries):
    cfg = Linear.default_config().set(input_dim=16, output_dim=32, bias=False)
    layer = cfg.instantiate(name="layer", registries=registries)
    params = layer.initialize(jax.random.key(0))
    assert set(params) == {"weight"}
    assert params["weight"].shape == (16, 32)
    x = _x((7, 16))
    expected = x.astype(np.float64) @ np.asarray(params["weight"], np.float64)
    np.testing.assert_allclose(_run(layer, params, (x,)), expected, rtol=RTOL, atol=ATOL)


def test_linear_bias_is_initialized_to_zero_and_weight_is_random(registries):
    layer = Linear.default_config().set(input_dim=16, output_dim=32).instantiate(name="layer", registries=registries)
    params = layer.initialize(jax.random.key(3))
    np.testing.assert_array_equal(params["bias"], np.zeros(32, np.float32))
    assert np.std(np.asarray(params["weight"])) > 0.05


# -- Embedding ---------------------------------------------------------------------------


def test_embedding_forward_is_a_row_lookup(registries):
    layer = Embedding.default_config().set(num_embeddings=32, dim=16).instantiate(name="emb", registries=registries)
    params = layer.initialize(jax.random.key(0))
    ids = np.array([[0, 3, 31], [7, 7, 1]], np.int32)
    table = np.asarray(params["weight"])
    out = _run(layer, params, (ids,))
    assert out.shape == (2, 3, 16)
    np.testing.assert_array_equal(out, table[ids])


def test_embedding_attend_is_x_times_table_transposed(registries):
    cfg = Embedding.default_config().set(num_embeddings=32, dim=16)
    layer = cfg.clone(tied_head=True).instantiate(name="emb", registries=registries)
    params = layer.initialize(jax.random.key(0))
    x = _x((2, 3, 16))
    expected = x.astype(np.float64) @ np.asarray(params["weight"], np.float64).T
    out = _run(layer, params, (x,), method="attend")
    assert out.shape == (2, 3, 32) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
    untied = cfg.instantiate(name="emb", registries=registries)  # No output-head site declared: attend refuses.
    with pytest.raises(ConfigError, match="tied_head"):
        _run(untied, params, (x,), method="attend")


# -- Norms -------------------------------------------------------------------------------


def _np_rms_norm(x, scale, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _np_layer_norm(x, scale, bias, eps):
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm_matches_numpy(eps, registries):
    layer = RMSNorm.default_config().set(input_dim=16, eps=eps).instantiate(name="norm", registries=registries)
    params = layer.initialize(jax.random.key(0))
    np.testing.assert_array_equal(params["scale"], np.ones(16, np.float32))
    params = _perturb(params, seed=2)
    x = 3.0 * _x((2, 4, 16)) + 1.0
    expected = _np_rms_norm(x, np.asarray(params["scale"], np.float64), eps)
    np.testing.assert_allclose(_run(layer, params, (x,)), expected, rtol=RTOL, atol=ATOL)


def test_rms_norm_keeps_bfloat16_input_dtype(registries):
    layer = RMSNorm.default_config().set(input_dim=16).instantiate(name="norm", registries=registries)
    params = layer.initialize(jax.random.key(0))
    x = jnp.asarray(_x((3, 16)), jnp.bfloat16)
    out = _run(layer, params, (x,))
    assert out.dtype == jnp.bfloat16
    expected = _np_rms_norm(np.asarray(x, np.float64), 1.0, 1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_numpy(bias, registries):
    layer = LayerNorm.default_config().set(input_dim=16, bias=bias).instantiate(name="norm", registries=registries)
    params = layer.initialize(jax.random.key(0))
    assert set(params) == ({"scale", "bias"} if bias else {"scale"})
    params = _perturb(params, seed=3)
    x = 2.0 * _x((2, 4, 16)) - 0.7
    b = np.asarray(params["bias"], np.float64) if bias else 0.0
    expected = _np_layer_norm(x, np.asarray(params["scale"], np.float64), b, 1e-5)
    np.testing.assert_allclose(_run(layer, params, (x,)), expected, rtol=RTOL, atol=ATOL)


# -- Specs, weight decay, dtypes -----------------------------------------------------------


def test_weight_decay_scale_is_zero_for_biases_and_norm_scales_and_one_for_weights(registries):
    from axcore.layers import TransformerLayer

    cfg = TransformerLayer.default_config().set(input_dim=8, norm=LayerNorm.default_config())
    cfg.self_attention.num_heads = 2
    cfg.feed_forward.hidden_dim = 16
    cfg.feed_forward.linear.bias = True
    specs = cfg.instantiate(name="layer", registries=registries).parameter_specs()
    flat = {jax.tree_util.keystr(path): spec for path, spec in jax.tree_util.tree_leaves_with_path(specs)}
    decays = {path: spec.weight_decay_scale for path, spec in flat.items()}
    for path, decay in decays.items():
        expected = 0.0 if path.endswith("['bias']") or path.endswith("['scale']") else 1.0
        assert decay == expected, path
    # Both kinds are present.
    assert sorted(set(decays.values())) == [0.0, 1.0]
    assert any("['wq']" in p for p in decays) and any("['up_proj']['bias']" in p for p in decays)


def _layer_cfgs(param_dtype):
    return [
        Linear.default_config().set(input_dim=16, output_dim=32, param_dtype=param_dtype),
        # (An embedding in bfloat16 would only add a compile: its init is the same code path.)
        *([Embedding.default_config().set(num_embeddings=32, dim=16)] if param_dtype == "float32" else []),
        RMSNorm.default_config().set(input_dim=16, param_dtype=param_dtype),
        LayerNorm.default_config().set(input_dim=16, param_dtype=param_dtype),
    ]


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_abstract_parameters_match_initialized_shapes_and_dtypes(param_dtype, registries):
    for cfg in _layer_cfgs(param_dtype):
        layer = cfg.instantiate(name="layer", registries=registries)
        abstract = layer.abstract_parameters()
        concrete = layer.initialize(jax.random.key(0))
        assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
        for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)):
            assert isinstance(a, jax.ShapeDtypeStruct)
            assert a.shape == c.shape
            assert a.dtype == c.dtype == jnp.dtype(param_dtype)
        specs = layer.parameter_specs()
        for spec, c in zip(jax.tree.leaves(specs), jax.tree.leaves(concrete)):
            assert isinstance(spec, axcore.ParameterSpec)
            assert spec.shape == c.shape


def test_bfloat16_params_compute_in_the_compute_dtype(registries):
    # bfloat16 storage alone: the weight is cast to the (inherited, float32) compute dtype.
    layer = Linear.default_config().set(input_dim=16, output_dim=32, param_dtype="bfloat16")
    layer = layer.instantiate(name="l", registries=registries)
    params = layer.initialize(jax.random.key(0))
    assert params["weight"].dtype == jnp.bfloat16
    x = _x((5, 16))
    out = _run(layer, params, (x,))
    assert out.dtype == jnp.float32
    w = np.asarray(params["weight"].astype(jnp.float32), np.float64)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=RTOL, atol=ATOL)


def test_bfloat16_compute_dtype_linear_computes_and_returns_bfloat16(registries):
    cfg = Linear.default_config().set(input_dim=16, output_dim=32, param_dtype="bfloat16", compute_dtype="bfloat16")
    layer = cfg.instantiate(name="l", registries=registries)
    params = layer.initialize(jax.random.key(0))
    x = _x((5, 16))
    out = _run(layer, params, (x,))
    assert out.dtype == jnp.bfloat16  # Output dtype == compute dtype.
    # Both operands are rounded to bfloat16 before the matmul.
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    w = np.asarray(params["weight"].astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), x16 @ w, rtol=2e-2, atol=2e-2)


def test_parameter_specs_of_huge_layers_allocate_nothing(registries):
    # 400 GB of float32 if it were materialized.
    cfg = Embedding.default_config().set(num_embeddings=1_000_000, dim=100_000)
    layer = cfg.instantiate(name="emb", registries=registries)
    abstract = layer.abstract_parameters()
    assert abstract["weight"].shape == (1_000_000, 100_000)
    assert abstract["weight"].dtype == jnp.float32
    assert layer.parameter_specs()["weight"].mesh_axes == ("vocab", "embed")


def test_initialize_is_deterministic_per_key_and_differs_across_keys(registries):
    layer = Linear.default_config().set(input_dim=16, output_dim=32).instantiate(name="layer", registries=registries)
    a = layer.initialize(jax.random.key(0))["weight"]
    b = layer.initialize(jax.random.key(0))["weight"]
    c = layer.initialize(jax.random.key(1))["weight"]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
