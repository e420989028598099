"""The `rms_norm` op's oracle: a float64 NumPy formula of the output and its VJP, test cases and one check
that every `rms_norm` kernel's test (axcore's reference kernel, the gpu plugin's fused ones) goes through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

RMS_NORM_EPS = 1e-6
# (shape of x, dtype): a non-power-of-two dim (96), odd row counts.
RMS_NORM_CASES = {
    "f32 [4, 9, 96]": ((4, 9, 96), jnp.float32),
    "f32 [33, 128]": ((33, 128), jnp.float32),
    "bf16 [4, 9, 96]": ((4, 9, 96), jnp.bfloat16),
    "bf16 [5, 256]": ((5, 256), jnp.bfloat16),
}
# Tolerances against float64: float32 math (observed ~1e-6); bfloat16 output/inputs: a bf16 ulp
# of the output (2^-8 relative) plus the input gradient's own bf16 rounding.
RMS_NORM_TOLERANCE = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def np_rms_norm(x, scale, eps=RMS_NORM_EPS):
    """y = x / sqrt(mean(x^2) + eps) * scale in float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def np_rms_norm_vjp(x, scale, g, eps=RMS_NORM_EPS):
    """(dx, dscale) of `np_rms_norm` for output cotangent g, float64, by the chain rule:
    y_j = x_j r s_j with r = (mean(x^2) + eps)^-1/2, dr/dx_k = -r^3 x_k / d."""
    x, s, g = (np.asarray(a, np.float64) for a in (x, scale, g))
    d = x.shape[-1]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    gs = g * s
    dx = r * gs - (r**3 / d) * x * np.sum(gs * x, axis=-1, keepdims=True)
    dscale = np.sum((g * x * r).reshape(-1, d), axis=0)
    return dx, dscale


def rms_norm_case_arrays(shape, dtype, seed=0):
    """x (offset, so the mean square is not ~1), scale near 1 (float32) and a cotangent g, rounded to dtype."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(2.0 * rng.normal(size=shape) + 0.5, dtype)
    scale = jnp.asarray(1.0 + 0.3 * rng.normal(size=shape[-1:]), jnp.float32)
    g = jnp.asarray(rng.normal(size=shape), dtype)
    return x, scale, g


def check_rms_norm(fn, shape, dtype, tolerance=None):
    """Asserts fn(x, scale) -> y (x of `shape` and `dtype`, scale [shape[-1]] float32): its output and VJP
    equal the NumPy formula within `tolerance` (default RMS_NORM_TOLERANCE[dtype]), in x's and scale's dtypes."""
    x, scale, g = rms_norm_case_arrays(shape, dtype)
    y, vjp = jax.vjp(fn, x, scale)
    dx, dscale = vjp(g)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dscale.dtype == scale.dtype
    tol = tolerance or RMS_NORM_TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(y, np.float64), np_rms_norm(x, scale), **tol)
    want_dx, want_dscale = np_rms_norm_vjp(x, scale, g)
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, **tol)
    # dscale sums a row count of terms: relative to its size.
    np.testing.assert_allclose(np.asarray(dscale, np.float64), want_dscale, rtol=tol["rtol"],
                               atol=tol["atol"] * np.sqrt(np.prod(shape[:-1])))
