"""TransformerLayer (pre-norm, residual dropout) and StackedTransformer against NumPy."""

import math

import jax
import numpy as np
import pytest

import axcore
from axcore.layers import StackedTransformer, TransformerLayer

RTOL = ATOL = 1e-5
DIM, HEADS, HIDDEN = 16, 4, 32

_erf = np.vectorize(math.erf)


def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def np_rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_self_attention(p, x, causal, kv_mask=None):
    q = np.einsum("btd,dnh->btnh", x, p["wq"])
    k = np.einsum("btd,dnh->btnh", x, p["wk"])
    v = np.einsum("btd,dnh->btnh", x, p["wv"])
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    t = x.shape[1]
    allowed = np.ones((1, 1, t, t), bool)
    if causal:
        allowed = allowed & np.tril(np.ones((t, t), bool))
    if kv_mask is not None:
        allowed = allowed & kv_mask[:, None, None, :]
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", probs, v), p["wo"])


def np_gelu_ffn(p, x):
    h = x @ p["up_proj"]["weight"]
    h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
    return h @ p["down_proj"]["weight"]


def np_transformer_layer(p, x, causal, kv_mask=None):
    """x1 = x + attn(rmsnorm(x)); out = x1 + ffn(rmsnorm(x1))."""
    x1 = x + np_self_attention(p["self_attention"], np_rms_norm(x, p["attention_norm"]["scale"]), causal, kv_mask)
    return x1 + np_gelu_ffn(p["feed_forward"], np_rms_norm(x1, p["ffn_norm"]["scale"]))


def _layer_cfg(causal=True, hidden=HIDDEN, dropout_rate=0.0):
    cfg = TransformerLayer.default_config().set(input_dim=DIM, dropout_rate=dropout_rate)
    cfg.self_attention.set(num_heads=HEADS, causal=causal)
    cfg.feed_forward.hidden_dim = hidden
    return cfg


def _random_norm_scales(params, seed):
    """Norm scales initialize to ones; make them distinct so swapping the two norms shows."""
    rng = np.random.default_rng(seed)

    def fix(path, leaf):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return (1.0 + 0.5 * rng.normal(size=leaf.shape)).astype(np.float32)
        return leaf

    return jax.tree_util.tree_map_with_path(fix, params)


def _x(shape=(2, 6, DIM), seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _run(layer, params, inputs, *, is_training=False, prng_key=None):
    out, _ = axcore.functional(layer, params, inputs=inputs, prng_key=prng_key, is_training=is_training)
    return np.asarray(out)


@pytest.mark.parametrize("causal", [True, False])
def test_transformer_layer_is_pre_norm_residual(causal, registries):
    layer = _layer_cfg(causal).instantiate(name="layer", registries=registries)
    params = _random_norm_scales(layer.initialize(jax.random.key(0)), seed=0)
    x = _x()
    expected = np_transformer_layer(_np(params), x.astype(np.float64), causal)
    np.testing.assert_allclose(_run(layer, params, (x,)), expected, rtol=RTOL, atol=ATOL)


def test_transformer_layer_passes_kv_mask_to_attention(registries):
    layer = _layer_cfg(causal=False).instantiate(name="layer", registries=registries)
    params = _random_norm_scales(layer.initialize(jax.random.key(0)), seed=1)
    x = _x()
    kv_mask = np.array([[True] * 6, [True] * 3 + [False] * 3])
    expected = np_transformer_layer(_np(params), x.astype(np.float64), False, kv_mask)
    np.testing.assert_allclose(_run(layer, params, {"x": x, "kv_mask": kv_mask}), expected, rtol=RTOL, atol=ATOL)
    assert not np.allclose(expected, np_transformer_layer(_np(params), x.astype(np.float64), False), atol=1e-3)


# -- Dropout -----------------------------------------------------------------------------


def _dropout_layer(registries):
    layer = _layer_cfg(dropout_rate=0.5).instantiate(name="layer", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


def test_dropout_in_training_changes_output_deterministically_per_key(registries):
    layer, params = _dropout_layer(registries)
    x = _x()
    eval_out = _run(layer, params, (x,))
    a = _run(layer, params, (x,), is_training=True, prng_key=jax.random.key(7))
    b = _run(layer, params, (x,), is_training=True, prng_key=jax.random.key(7))
    c = _run(layer, params, (x,), is_training=True, prng_key=jax.random.key(8))
    assert not np.allclose(a, eval_out, atol=1e-3)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c, atol=1e-3)


def test_dropout_is_ignored_in_evaluation(registries):
    layer, params = _dropout_layer(registries)
    x = _x()
    out = _run(layer, params, (x,), is_training=False, prng_key=jax.random.key(7))
    np.testing.assert_allclose(out, np_transformer_layer(_np(params), x.astype(np.float64), True), rtol=RTOL, atol=ATOL)


def test_training_without_dropout_equals_evaluation(registries):
    layer = _layer_cfg(dropout_rate=0.0).instantiate(name="layer", registries=registries)
    params = layer.initialize(jax.random.key(0))
    x = _x()
    np.testing.assert_array_equal(
        _run(layer, params, (x,), is_training=True, prng_key=jax.random.key(3)), _run(layer, params, (x,))
    )


def test_dropout_in_training_without_key_raises(registries):
    layer, params = _dropout_layer(registries)
    with pytest.raises(ValueError, match="prng_key"):
        _run(layer, params, (_x(),), is_training=True, prng_key=None)


def test_dropout_with_rate_one_half_zeroes_or_doubles_the_attention_branch(registries):
    """With a zero feed-forward, out = x + dropout(attn(norm(x))): each entry is x or x + 2 * attn."""
    layer, params = _dropout_layer(registries)
    params = jax.tree.map(lambda a: a, params)
    params["feed_forward"]["down_proj"]["weight"] = np.zeros((HIDDEN, DIM), np.float32)
    x = _x()
    attn = _run(layer, params, (x,)) - x
    out = _run(layer, params, (x,), is_training=True, prng_key=jax.random.key(11))
    dropped = np.isclose(out, x, atol=1e-6)
    kept = np.isclose(out, x + 2.0 * attn, atol=1e-5)
    assert np.all(dropped | kept)
    assert 0.3 < dropped.mean() < 0.7


# -- StackedTransformer ------------------------------------------------------------------


def test_stacked_transformer_applies_layers_in_order(registries):
    cfg = StackedTransformer.default_config().set(input_dim=DIM, num_layers=2, layer=_layer_cfg())
    stack = cfg.instantiate(name="stack", registries=registries)
    params = _random_norm_scales(stack.initialize(jax.random.key(0)), seed=2)
    assert set(params) == {"layer0", "layer1"}
    assert not np.allclose(params["layer0"]["self_attention"]["wq"], params["layer1"]["self_attention"]["wq"])
    x = _x()
    kv_mask = np.array([[True] * 6, [True] * 5 + [False]])
    p = _np(params)
    expected = np_transformer_layer(p["layer1"], np_transformer_layer(p["layer0"], x.astype(np.float64), True, kv_mask), True, kv_mask)
    out = _run(stack, params, {"x": x, "kv_mask": kv_mask})
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
    # Order matters: applying layer1 first gives something else.
    swapped = np_transformer_layer(p["layer0"], np_transformer_layer(p["layer1"], x.astype(np.float64), True, kv_mask), True, kv_mask)
    assert not np.allclose(out, swapped, atol=1e-3)


def test_stacked_transformer_accepts_one_config_per_layer(registries):
    layers = [_layer_cfg(hidden=32), _layer_cfg(hidden=16, causal=False)]
    cfg = StackedTransformer.default_config().set(input_dim=DIM, num_layers=2, layer=layers)
    stack = cfg.instantiate(name="stack", registries=registries)
    params = stack.initialize(jax.random.key(1))
    assert params["layer0"]["feed_forward"]["up_proj"]["weight"].shape == (DIM, 32)
    assert params["layer1"]["feed_forward"]["up_proj"]["weight"].shape == (DIM, 16)
    x = _x()
    p = _np(params)
    expected = np_transformer_layer(p["layer1"], np_transformer_layer(p["layer0"], x.astype(np.float64), True), False)
    np.testing.assert_allclose(_run(stack, params, (x,)), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("num_configs", [1, 3])
def test_stacked_transformer_rejects_list_of_wrong_length(num_configs, registries):
    cfg = StackedTransformer.default_config().set(
        input_dim=DIM, num_layers=2, layer=[_layer_cfg() for _ in range(num_configs)]
    )
    with pytest.raises(axcore.ConfigError, match="num_layers"):
        cfg.instantiate(name="stack", registries=registries)
