"""MultiheadAttention against a NumPy softmax(QK^T / sqrt(h)) V using the layer's weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.layers import MultiheadAttention, PositionEmbedding

RTOL = ATOL = 1e-5


def np_attention(q, k, v, *, scale, causal=False, kv_mask=None, bias=None):
    """Plain MHA: q [B,T,N,H], k/v [B,S,N,H] (same number of heads), float64."""
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + bias
    t, s = q.shape[1], k.shape[1]
    allowed = np.ones((1, 1, t, s), bool)
    if causal:
        allowed = allowed & (np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t))[None, None]
    if kv_mask is not None:
        allowed = allowed & kv_mask[:, None, None, :]
    logits = np.where(allowed, logits, -np.inf)
    logits = logits - logits.max(-1, keepdims=True)
    probs = np.exp(logits)
    probs = probs / probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


def np_mha_layer(params, x, *, causal=False, kv_mask=None, scale=None, q_fn=None, bias=None):
    """The layer's forward by hand: project, repeat kv heads for GQA, attend, output-project."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    q = np.einsum("btd,dnh->btnh", x, p["wq"])
    k = np.einsum("btd,dnh->btnh", x, p["wk"])
    v = np.einsum("btd,dnh->btnh", x, p["wv"])
    if q_fn is not None:
        q = q_fn(q)
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    out = np_attention(q, k, v, scale=scale, causal=causal, kv_mask=kv_mask, bias=bias)
    return np.einsum("btnh,nhd->btd", out, p["wo"])


def _layer(registries, **kw):
    cfg = MultiheadAttention.default_config().set(input_dim=16, num_heads=4, **kw)
    layer = cfg.instantiate(name="attn", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


def _x(shape=(2, 6, 16), seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _run(layer, params, inputs):
    out, _ = axcore.functional(layer, params, inputs=inputs, prng_key=None, is_training=False)
    return out


def _gqa_layer(registries, num_kv_heads, causal=False):
    # head_dim 4 is set explicitly (the default would be 16 // 8 = 2).
    cfg = MultiheadAttention.default_config().set(
        input_dim=16, num_heads=8, num_kv_heads=num_kv_heads, head_dim=4, causal=causal
    )
    layer = cfg.instantiate(name="attn", registries=registries)
    return layer, layer.initialize(jax.random.key(2))


def test_param_shapes_follow_heads_kv_heads_and_head_dim(registries):
    layer, params = _gqa_layer(registries, num_kv_heads=2)
    assert params["wq"].shape == (16, 8, 4)
    assert params["wk"].shape == params["wv"].shape == (16, 2, 4)
    assert params["wo"].shape == (8, 4, 16)
    assert not np.allclose(params["wk"], params["wv"])
    specs = layer.parameter_specs()
    assert specs["wq"].mesh_axes == ("embed", "heads", None)
    assert specs["wk"].mesh_axes == ("embed", "kv_heads", None)
    assert specs["wo"].mesh_axes == ("heads", None, "embed")


@pytest.mark.parametrize("causal", [False, True])
def test_mha_matches_numpy(causal, registries):
    layer, params = _layer(registries, causal=causal)
    x = _x()
    out = _run(layer, params, (x,))
    np.testing.assert_allclose(out, np_mha_layer(params, x, causal=causal), rtol=RTOL, atol=ATOL)


def test_causal_and_non_causal_differ_except_on_the_last_query(registries):
    causal, params = _layer(registries, causal=True)
    full, _ = _layer(registries, causal=False)
    x = _x()
    a, b = np.asarray(_run(causal, params, (x,))), np.asarray(_run(full, params, (x,)))
    assert not np.allclose(a[:, :-1], b[:, :-1], atol=1e-3)
    np.testing.assert_allclose(a[:, -1], b[:, -1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("causal", [False, True])
def test_kv_padding_mask_matches_numpy(causal, registries):
    layer, params = _layer(registries, causal=causal)
    x = _x()
    kv_mask = np.array([[True] * 6, [True, True, True, True, False, False]])
    out = _run(layer, params, ({"x": x, "kv_mask": kv_mask}))
    expected = np_mha_layer(params, x, causal=causal, kv_mask=kv_mask)
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
    # Padded keys have no influence on any query.
    x2 = x.copy()
    x2[1, 4:] = 100.0
    out2 = _run(layer, params, ({"x": x2, "kv_mask": kv_mask}))
    np.testing.assert_allclose(np.asarray(out2)[1, :4], np.asarray(out)[1, :4], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(num_kv_heads, causal, registries):
    layer, params = _gqa_layer(registries, num_kv_heads, causal)
    assert params["wk"].shape == (16, num_kv_heads, 4)
    x = _x(seed=3)
    kv_mask = np.array([[True] * 6, [True] * 5 + [False]])
    out = _run(layer, params, {"x": x, "kv_mask": kv_mask})
    # np_mha_layer repeats each kv head `group` times (np.repeat on the head axis), so query
    # head n uses kv head n // group: a plain MHA.
    np.testing.assert_allclose(
        out, np_mha_layer(params, x, causal=causal, kv_mask=kv_mask), rtol=RTOL, atol=ATOL
    )


def test_gqa_head_assignment_is_contiguous_not_interleaved(registries):
    """Query head n must use kv head n // group (not n % num_kv_heads)."""
    layer, params = _gqa_layer(registries, num_kv_heads=2)
    x = _x(seed=5)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    interleaved = dict(p, wk=np.tile(p["wk"], (1, 4, 1)), wv=np.tile(p["wv"], (1, 4, 1)))
    wrong = np_mha_layer(interleaved, x)  # Tiled kv heads: query head n -> kv head n % 2.
    right = np_mha_layer(params, x)
    out = np.asarray(_run(layer, params, (x,)))
    np.testing.assert_allclose(out, right, rtol=RTOL, atol=ATOL)
    assert not np.allclose(out, wrong, atol=1e-3)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 3), (4, 3), (2, 4)])
def test_num_heads_not_multiple_of_kv_heads_is_config_error(num_heads, num_kv_heads, registries):
    cfg = MultiheadAttention.default_config().set(input_dim=16, num_heads=num_heads, num_kv_heads=num_kv_heads)
    with pytest.raises(axcore.ConfigError, match="multiple"):
        cfg.instantiate(name="attn", registries=registries)


def test_explicit_softmax_scale(registries):
    layer, params = _layer(registries, scale=0.3, causal=True)
    x = _x()
    out = _run(layer, params, (x,))
    np.testing.assert_allclose(out, np_mha_layer(params, x, causal=True, scale=0.3), rtol=RTOL, atol=ATOL)
    # The default scale (1/sqrt(4)) gives a different answer.
    assert not np.allclose(out, np_mha_layer(params, x, causal=True), atol=1e-4)


class _ToyRelativePosition(PositionEmbedding):
    """Doubles queries and adds a distance penalty -0.5 * |i - j| to the logits."""

    def transform_qk(self, q, k, q_positions, k_positions):
        return 2.0 * q, k

    def attention_bias(self, q_positions, k_positions):
        dist = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
        return (-0.5 * dist)[:, None]


def test_position_embedding_slot_transforms_qk_and_adds_bias(registries):
    layer, params = _layer(registries, position_embedding=_ToyRelativePosition.default_config())
    assert layer.position_embedding.config.dim == 4 and layer.position_embedding.config.num_heads == 4
    x = _x()
    positions = np.array([[0, 1, 2, 3, 4, 5], [3, 5, 6, 9, 10, 11]])
    out = _run(layer, params, {"x": x, "positions": positions})
    dist = np.abs(positions[:, :, None] - positions[:, None, :])
    expected = np_mha_layer(params, x, q_fn=lambda q: 2.0 * q, bias=(-0.5 * dist)[:, None])
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
