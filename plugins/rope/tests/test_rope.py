"""The rotary embedding of the `rope` plugin (axcore-rope) against formulas written out in NumPy.

Pairing under test: rotate-half (GPT-NeoX / Hugging Face Llama): with r rotated dims,
feature i pairs with feature i + r/2 and pair i at position m turns by m * theta^(-2i/r).
The reference below is the RoFormer rotation written per position and pair in float64.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import from_yaml, to_yaml
from axcore.errors import ConfigError

from axcore_rope import RotaryEmbedding, Scaling, rotary_frequencies
from axcore_rope.rotary import yarn_mscale

# Registries of a plugin manager with the rope plugin (module helpers build layers with them).
REGISTRIES = axcore.create_plugin_manager(["rope"]).registries


def _layer(head_dim=16, **fields):
    cfg = RotaryEmbedding.default_config().set(dim=head_dim, num_heads=4, **fields)
    return cfg.instantiate(name="rotary", registries=REGISTRIES)


def _jitted(layer):
    """layer.transform_qk under jit (one compile per shape instead of one per eager op)."""

    def fn(*inputs):
        return axcore.functional(layer, {}, inputs, prng_key=None, is_training=False, method="transform_qk")[0]

    return jax.jit(fn)


def _apply(layer, q, k, q_pos, k_pos):
    q_out, k_out = _jitted(layer)(q, k, q_pos, k_pos)
    return np.asarray(q_out), np.asarray(k_out)


def _qk(head_dim=16, b=2, t=5, s=7, n=4, kv=2, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, head_dim)).astype(dtype)
    k = rng.normal(size=(b, s, kv, head_dim)).astype(dtype)
    q_pos = rng.integers(0, 64, size=(b, t))
    k_pos = rng.integers(0, 64, size=(b, s))
    return q, k, q_pos, k_pos


def plain_freqs(theta, r):
    """theta_i = theta^(-2i/r), one per pair."""
    return np.array([theta ** (-2.0 * i / r) for i in range(r // 2)], np.float64)


def reference_rope(x, positions, freqs, r, mscale=1.0):
    """RoFormer rotation per position m and pair i, rotate-half pairing (i, i + r/2), float64."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    half = r // 2
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            m = positions[b, t]
            for i in range(half):
                angle = m * freqs[i]
                x1, x2 = x[b, t, :, i], x[b, t, :, i + half]
                out[b, t, :, i] = mscale * (x1 * math.cos(angle) - x2 * math.sin(angle))
                out[b, t, :, i + half] = mscale * (x2 * math.cos(angle) + x1 * math.sin(angle))
    return out


def llama3_freqs(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's Llama 3.1 `apply_scaling`, transcribed as a loop."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new.append(freq)
        elif wavelen > low_freq_wavelen:
            new.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(new)


def yarn_freqs(theta, r, factor, beta_fast, beta_slow, original_max_len):
    """YaRN frequencies as in the reference code (jquesnelle/yarn, HF `_compute_yarn_parameters`).

    correction_dim(n) = r * ln(L / (n * 2 pi)) / (2 ln theta)   (pair index turning n times over L)
    low = max(floor(correction_dim(beta_fast)), 0), high = min(ceil(correction_dim(beta_slow)), r - 1)
    mask_i = 1 - clip((i - low) / (high - low), 0, 1)            (1: extrapolate = keep)
    f_i = f_i / factor * (1 - mask_i) + f_i * mask_i
    """
    def correction_dim(rotations):
        return (r * math.log(original_max_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), r - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.array([theta ** (2.0 * i / r) for i in range(r // 2)])
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    mask = 1.0 - np.clip((np.arange(r // 2) - low) / (high - low), 0.0, 1.0)
    return interpolation * (1 - mask) + extrapolation * mask


# -- Plain RoPE ---------------------------------------------------------------------------


def test_full_rotary_matches_the_roformer_formula():
    q, k, q_pos, k_pos = _qk()
    q_out, k_out = _apply(_layer(), q, k, q_pos, k_pos)
    freqs = plain_freqs(10000.0, 16)
    np.testing.assert_allclose(q_out, reference_rope(q, q_pos, freqs, 16), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(k_out, reference_rope(k, k_pos, freqs, 16), rtol=1e-5, atol=2e-5)
    assert q_out.shape == q.shape and k_out.shape == k.shape


def test_position_zero_is_the_identity_and_theta_is_used():
    q, k, _, _ = _qk()
    zeros_q, zeros_k = np.zeros(q.shape[:2], int), np.zeros(k.shape[:2], int)
    q_out, k_out = _apply(_layer(), q, k, zeros_q, zeros_k)
    np.testing.assert_array_equal(q_out, q)
    np.testing.assert_array_equal(k_out, k)
    q, k, q_pos, k_pos = _qk()
    q_out, _ = _apply(_layer(theta=500000.0), q, k, q_pos, k_pos)
    np.testing.assert_allclose(q_out, reference_rope(q, q_pos, plain_freqs(5e5, 16), 16), rtol=1e-5, atol=2e-5)


def test_partial_rotary_rotates_the_leading_dims_and_passes_the_rest_through():
    q, k, q_pos, k_pos = _qk(head_dim=16)
    q_out, k_out = _apply(_layer(rotary_fraction=0.5), q, k, q_pos, k_pos)
    np.testing.assert_array_equal(q_out[..., 8:], q[..., 8:])
    np.testing.assert_array_equal(k_out[..., 8:], k[..., 8:])
    # The rotated part uses r = 8 in the exponent (GPT-NeoX / Phi partial rotary).
    freqs = plain_freqs(10000.0, 8)
    np.testing.assert_allclose(q_out[..., :8], reference_rope(q[..., :8], q_pos, freqs, 8), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(k_out[..., :8], reference_rope(k[..., :8], k_pos, freqs, 8), rtol=1e-5, atol=2e-5)


def test_bfloat16_in_bfloat16_out_close_to_float32():
    q, k, q_pos, k_pos = _qk()
    layer = _layer()
    q16, k16 = _apply(layer, jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), q_pos, k_pos)
    assert q16.dtype == jnp.bfloat16 and k16.dtype == jnp.bfloat16
    q32, _ = _apply(layer, q, k, q_pos, k_pos)
    np.testing.assert_allclose(q16.astype(np.float32), q32, atol=0.05)


def test_large_positions_keep_float32_angle_accuracy():
    q, k, _, _ = _qk(t=2, s=2)
    pos = np.array([[100_000, 131_071], [65_536, 7]])
    q_out, _ = _apply(_layer(theta=500000.0), q, k, pos, pos)
    # Angles up to ~1.3e5 rad in float32 carry ~1e-2 rad of rounding at most.
    np.testing.assert_allclose(q_out, reference_rope(q, pos, plain_freqs(5e5, 16), 16), atol=3e-2)


@pytest.mark.parametrize(
    "fields",
    [{}, {"rotary_fraction": 0.5}, {"scaling": "llama3", "original_max_len": 16, "scaling_factor": 4.0},
     {"scaling": "yarn", "original_max_len": 64, "scaling_factor": 4.0}],
    ids=["full", "partial", "llama3", "yarn"],
)
def test_scores_depend_only_on_relative_position(fields):
    q, k, _, _ = _qk(b=1, t=6, s=6)
    transform = _jitted(_layer(**fields))
    m = np.array([[0, 3, 9, 20, 31, 50]])
    n = np.array([[5, 1, 9, 0, 44, 13]])

    def scores(q_pos, k_pos):
        q_out, k_out = transform(q, k, q_pos, k_pos)
        return np.einsum("btnh,bskh->btsnk", q_out, k_out)

    np.testing.assert_allclose(scores(m, n), scores(m + 7, n + 7), rtol=1e-4, atol=1e-4)
    assert not np.allclose(scores(m, n), scores(m + 7, n))  # Positions matter at all.


# -- Frequency scaling ---------------------------------------------------------------------


def test_llama3_frequencies_match_metas_reference():
    # Llama 3.1 8B: head_dim 128, theta 500000, factor 8, low 1, high 4, original 8192.
    cfg = RotaryEmbedding.default_config().set(theta=500000.0, scaling="llama3")
    got = rotary_frequencies(cfg, 128)
    base = plain_freqs(500000.0, 128)
    expected = llama3_freqs(base, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    # All three regimes occur: kept, divided by the factor, smoothly interpolated.
    kept, divided = np.isclose(got, base), np.isclose(got, base / 8)
    assert kept.sum() > 0 and divided.sum() > 0 and (~kept & ~divided).sum() > 0


def test_llama3_rotation_uses_the_scaled_frequencies():
    fields = {"theta": 500000.0, "scaling": "llama3", "scaling_factor": 8.0, "original_max_len": 64}
    q, k, q_pos, k_pos = _qk(head_dim=32)
    q_out, k_out = _apply(_layer(head_dim=32, **fields), q, k, q_pos, k_pos)
    freqs = llama3_freqs(plain_freqs(5e5, 32), 8.0, 1.0, 4.0, 64)
    assert not np.allclose(freqs, plain_freqs(5e5, 32))
    np.testing.assert_allclose(q_out, reference_rope(q, q_pos, freqs, 32), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(k_out, reference_rope(k, k_pos, freqs, 32), rtol=1e-5, atol=2e-5)


def test_yarn_frequencies_match_the_reference_formula_and_the_papers_regimes():
    theta, r, factor, length = 10000.0, 64, 4.0, 4096
    cfg = RotaryEmbedding.default_config().set(scaling="yarn", scaling_factor=factor, original_max_len=length)
    got = rotary_frequencies(cfg, r)
    np.testing.assert_allclose(got, yarn_freqs(theta, r, factor, 32.0, 1.0, length), rtol=1e-12)
    # The paper's NTK-by-parts regimes: pairs turning more than beta_fast times over the
    # original context keep their frequency; fewer than beta_slow times are divided by s.
    base = plain_freqs(theta, r)
    turns = length * base / (2 * math.pi)
    np.testing.assert_allclose(got[turns > 32], base[turns > 32], rtol=1e-12)
    np.testing.assert_allclose(got[turns < 1], base[turns < 1] / factor, rtol=1e-12)
    between = (turns <= 32) & (turns >= 1)
    assert between.sum() > 3 and np.all((got[between] <= base[between]) & (got[between] >= base[between] / factor))


def test_yarn_rotation_and_attention_temperature():
    fields = {"scaling": "yarn", "scaling_factor": 4.0, "original_max_len": 64}
    q, k, q_pos, k_pos = _qk(head_dim=32)
    layer = _layer(head_dim=32, rotary_fraction=0.5, **fields)
    q_out, k_out = _apply(layer, q, k, q_pos, k_pos)
    mscale = 0.1 * math.log(4.0) + 1.0
    assert yarn_mscale(layer.config) == pytest.approx(mscale)
    freqs = yarn_freqs(10000.0, 16, 4.0, 32.0, 1.0, 64)
    # mscale multiplies the rotated features of both q and k; pass-through dims are untouched.
    for x, pos, out in [(q, q_pos, q_out), (k, k_pos, k_out)]:
        expected = reference_rope(x[..., :16], pos, freqs, 16, mscale)
        np.testing.assert_allclose(out[..., :16], expected, rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(q_out[..., 16:], q[..., 16:])
    # No temperature without yarn, or for a factor <= 1.
    assert yarn_mscale(RotaryEmbedding.default_config().set(scaling="llama3")) == 1.0
    assert yarn_mscale(RotaryEmbedding.default_config().set(scaling="yarn", scaling_factor=1.0)) == 1.0


# -- Config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,pattern",
    [
        ({"theta": 0.0}, r"'rotary\.theta' must be > 0"),
        ({"rotary_fraction": 0.0}, r"'rotary\.rotary_fraction' must be in \(0, 1\]"),
        ({"rotary_fraction": 1.5}, r"'rotary\.rotary_fraction' must be in \(0, 1\]"),
        ({"rotary_fraction": 0.3}, r"'rotary\.rotary_fraction'.*head_dim 16.*even.*4\.8"),
        ({"rotary_fraction": 0.0625}, r"'rotary\.rotary_fraction'.*even number of rotated dims \(is 1\)"),
        ({"scaling": "llama3", "high_freq_factor": 1.0}, r"'rotary\.high_freq_factor' must be > low_freq_factor"),
        ({"scaling": "yarn", "beta_fast": 0.5}, r"'rotary\.beta_fast' must be > beta_slow"),
        ({"scaling": "yarn", "scaling_factor": -2.0}, r"'rotary\.scaling_factor' must be > 0"),
    ],
)
def test_invalid_configs_name_the_field(fields, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _layer(**fields)


def test_dim_must_come_from_a_slot():
    with pytest.raises(ConfigError, match="dim is unset.*position_embedding slot"):
        RotaryEmbedding.default_config().instantiate(name="rotary", registries=REGISTRIES)


def test_config_round_trips_through_yaml_by_registered_name():
    cfg = RotaryEmbedding.default_config().set(theta=5e5, rotary_fraction=0.25, scaling="yarn", beta_fast=16)
    text = to_yaml(cfg, REGISTRIES)
    assert text.startswith("type: rotary\n") and "scaling: yarn" in text
    back = from_yaml(text, REGISTRIES)
    assert back == cfg and back.scaling is Scaling.YARN


def test_rotary_has_no_parameters():
    assert _layer().parameter_specs() == {}
