"""XlaAttention, causal_mask and AttentionProblem against NumPy (every capability of the problem)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.kernels import AttentionProblem, XlaAttention, causal_mask

RTOL = ATOL = 1e-5
B, T, N, H = 2, 6, 4, 4


def np_attention(q, k, v, *, scale, causal=False, kv_mask=None, bias=None, window=None, segments=None, softcap=None):
    """softmax(cap(q k^T * scale) + bias, masked) v in float64; query head n uses kv head n // group."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    t, s = q.shape[1], k.shape[1]
    allowed = np.ones((1, 1, t, s), bool)
    if causal:
        allowed = allowed & (np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t))
    if window is not None:
        allowed = allowed & (np.arange(t)[:, None] + (s - t) - np.arange(s)[None, :] < window)
    if segments is not None:
        seg = np.asarray(segments)
        allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
    if kv_mask is not None:
        allowed = allowed & np.asarray(kv_mask)[:, None, None, :]
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


def xla(q, k, v, *, scale, causal=False, kv_mask=None, bias=None, **flags):
    """The reference kernel called the way the attention layer calls it."""
    problem = AttentionProblem.of(
        q, k, scale=scale, causal=causal, has_kv_mask=kv_mask is not None, has_bias=bias is not None, **flags
    )
    inputs = {name: value for name, value in (("kv_mask", kv_mask), ("bias", bias)) if value is not None}
    return XlaAttention()(problem, q, k, v, **inputs)


def _qkv(q_len=T, kv_len=T, num_heads=N, num_kv_heads=N, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, q_len, num_heads, H)).astype(np.float32)
    k = rng.normal(size=(B, kv_len, num_kv_heads, H)).astype(np.float32)
    v = rng.normal(size=(B, kv_len, num_kv_heads, H)).astype(np.float32)
    return q, k, v


def _xla(q, k, v, *, causal=False, bias=None, kv_mask=None, scale=0.5):
    return np.asarray(xla(q, k, v, causal=causal, bias=bias, kv_mask=kv_mask, scale=scale))


@pytest.mark.parametrize("causal", [False, True])
def test_xla_attention_matches_numpy(causal):
    q, k, v = _qkv()
    np.testing.assert_allclose(_xla(q, k, v, causal=causal), np_attention(q, k, v, scale=0.5, causal=causal), rtol=RTOL, atol=ATOL)


def test_xla_attention_with_kv_mask_and_causal():
    q, k, v = _qkv(seed=1)
    kv_mask = np.array([[True] * T, [True, False, True, True, False, True]])
    out = _xla(q, k, v, causal=True, kv_mask=kv_mask, scale=0.7)
    np.testing.assert_allclose(out, np_attention(q, k, v, scale=0.7, causal=True, kv_mask=kv_mask), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bias_shape", [(1, 1, T, T), (B, N, T, T), (B, 1, T, T)])
def test_xla_attention_adds_bias_to_the_scaled_logits(bias_shape):
    q, k, v = _qkv(seed=2)
    bias = np.random.default_rng(3).normal(size=bias_shape).astype(np.float32)
    out = _xla(q, k, v, bias=bias, causal=True)
    np.testing.assert_allclose(out, np_attention(q, k, v, scale=0.5, bias=bias, causal=True), rtol=RTOL, atol=ATOL)
    # Bias is added after scaling (not scaled itself).
    wrong = np_attention(q, k, v, scale=0.5, bias=0.5 * bias, causal=True)
    assert not np.allclose(out, wrong, atol=1e-3)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_xla_grouped_query_attention_equals_mha_with_repeated_kv(num_kv_heads):
    q, k, v = _qkv(num_kv_heads=num_kv_heads, seed=4)
    group = N // num_kv_heads
    out = _xla(q, k, v, causal=True)
    mha = _xla(q, np.repeat(k, group, axis=2), np.repeat(v, group, axis=2), causal=True)
    np.testing.assert_allclose(out, mha, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out, np_attention(q, k, v, scale=0.5, causal=True), rtol=RTOL, atol=ATOL)


def test_causal_with_fewer_queries_than_keys_is_end_aligned():
    q, k, v = _qkv(q_len=2, kv_len=T, seed=5)
    out = _xla(q, k, v, causal=True)
    np.testing.assert_allclose(out, np_attention(q, k, v, scale=0.5, causal=True), rtol=RTOL, atol=ATOL)
    # The last query sees every key.
    np.testing.assert_allclose(out[:, -1], np_attention(q, k, v, scale=0.5)[:, -1], rtol=RTOL, atol=ATOL)


def test_causal_mask_is_end_aligned_lower_triangle():
    np.testing.assert_array_equal(causal_mask(4, 4), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(
        causal_mask(2, 4), np.array([[True, True, True, False], [True, True, True, True]])
    )


def test_fully_masked_rows_are_finite_uniform_averages():
    q, k, v = _qkv(seed=6)
    kv_mask = np.array([[True] * T, [False] * T])
    out = _xla(q, k, v, kv_mask=kv_mask, causal=True)
    assert np.all(np.isfinite(out))
    # Every key masked: a uniform average over all keys, per head.
    expected = np.broadcast_to(v[1].astype(np.float64).mean(0), (T, N, H))
    np.testing.assert_allclose(out[1], expected, rtol=RTOL, atol=ATOL)
    # The unmasked example is unaffected.
    np.testing.assert_allclose(out[0], np_attention(q, k, v, scale=0.5, causal=True)[0], rtol=RTOL, atol=ATOL)


def test_fully_masked_rows_have_finite_gradients():
    q, k, v = _qkv(seed=7)
    kv_mask = np.array([[True] * T, [False] * T])

    def loss(q, k, v):
        return jnp.sum(xla(q, k, v, causal=False, kv_mask=kv_mask, scale=0.5) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))


def test_bfloat16_inputs_give_bfloat16_output():
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in _qkv(seed=8))
    out = xla(q, k, v, causal=True, scale=0.5)
    assert out.dtype == jnp.bfloat16
    expected = np_attention(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32), scale=0.5, causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=3e-2, atol=3e-2)


def test_attention_problem_describes_the_call():
    q, k, _ = _qkv(q_len=3, kv_len=T, num_kv_heads=2)
    problem = AttentionProblem.of(q, k, causal=True, has_kv_mask=True)
    assert (problem.batch, problem.q_len, problem.kv_len) == (B, 3, T)
    assert (problem.num_heads, problem.num_kv_heads, problem.head_dim) == (N, 2, H)
    assert problem.dtype == np.float32
    assert problem.causal and problem.has_kv_mask and not problem.has_bias
    assert problem.platform == jax.default_backend()


def test_xla_kernel_supports_multiples_only():
    kernel = XlaAttention()
    assert kernel.name == "xla" and kernel.priority == 0
    q, k, _ = _qkv(num_kv_heads=2)
    assert kernel.is_supported(AttentionProblem.of(q, k))
    q3 = np.zeros((B, T, 3, H), np.float32)
    support = kernel.is_supported(AttentionProblem.of(q3, k))
    assert not support
    assert "multiple" in support.reason


def test_sliding_window_segments_and_softcap_match_numpy():
    q, k, v = _qkv(num_kv_heads=2, seed=11)
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])
    problem = AttentionProblem.of(q, k, scale=0.5, causal=True, sliding_window=2, has_segment_ids=True, softcap=1.5)
    out = XlaAttention()(problem, q, k, v, q_segment_ids=segments, kv_segment_ids=segments)
    expected = np_attention(q, k, v, scale=0.5, causal=True, window=2, segments=segments, softcap=1.5)
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
    # The window really cut something: without it the result differs.
    assert not np.allclose(expected, np_attention(q, k, v, scale=0.5, causal=True, segments=segments, softcap=1.5))


def test_alibi_slopes_and_bias_function_equal_the_dense_bias():
    q, k, v = _qkv(seed=12)
    slopes = (0.5, 0.25, 0.125, 0.0625)
    positions = np.broadcast_to(np.arange(T), (B, T))
    dense = -np.asarray(slopes)[None, :, None, None] * np.abs(np.arange(T)[:, None] - np.arange(T)[None, :])
    expected = np_attention(q, k, v, scale=0.5, causal=True, bias=dense)
    by_slopes = XlaAttention()(AttentionProblem.of(q, k, scale=0.5, causal=True, bias_slopes=slopes), q, k, v,
                               q_positions=positions, kv_positions=positions)
    np.testing.assert_allclose(by_slopes, expected, rtol=RTOL, atol=ATOL)
    bias_fn = lambda qp, kp: jnp.asarray(dense, jnp.float32) + 0 * (qp[:, None, :, None] - kp[:, None, None, :])  # noqa: E731
    by_fn = XlaAttention()(AttentionProblem.of(q, k, scale=0.5, causal=True, bias_fn=bias_fn), q, k, v,
                           q_positions=positions, kv_positions=positions)
    np.testing.assert_allclose(by_fn, expected, rtol=RTOL, atol=ATOL)


def test_dropout_zeroes_or_rescales_probabilities():
    q, k, v = _qkv(seed=13)
    problem = AttentionProblem.of(q, k, scale=0.5, dropout_rate=0.5)
    key = jax.random.key(3)
    out = XlaAttention()(problem, q, k, v, dropout_key=key)
    # The same draw in NumPy: probs * keep / (1 - rate).
    logits = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k.astype(np.float64)) * 0.5
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    keep = np.asarray(jax.random.bernoulli(key, 0.5, probs.shape))
    expected = np.einsum("bnts,bsnh->btnh", np.where(keep, probs / 0.5, 0.0), v.astype(np.float64))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_reference_kernel_declines_unknown_extras():
    q, k, _ = _qkv()
    support = XlaAttention().is_supported(AttentionProblem.of(q, k, extras={"attention_sink": 4}))
    assert not support and "attention_sink" in support.reason
