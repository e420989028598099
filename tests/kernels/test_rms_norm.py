"""The `rms_norm` op: its reference kernel against a float64 NumPy formula (output and gradients),
and `RMSNorm` running through the op (bit-identical to its former inline math; `kernels:` forcing).

`np_rms_norm` and `np_rms_norm_vjp` (axcore.testing) are the oracle of every `rms_norm` kernel's test (the gpu
plugin's reuse them); the VJP formula itself is checked against finite differences here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.errors import KernelNotSupportedError
from axcore.kernels import RMS_NORM, XlaRMSNorm, record_kernel_choices, rms_norm_problem, unknown_extras
from axcore.layers import RMSNorm
from axcore.module import functional
from axcore.testing import (
    RMS_NORM_CASES,
    RMS_NORM_EPS,
    check_rms_norm,
    np_rms_norm,
    np_rms_norm_vjp,
    rms_norm_case_arrays,
)


def test_numpy_vjp_formula_matches_finite_differences():
    rng = np.random.default_rng(1)
    x, s, g = rng.normal(size=(3, 7)) + 0.3, 1.0 + 0.2 * rng.normal(size=7), rng.normal(size=(3, 7))
    dx, ds = np_rms_norm_vjp(x, s, g, eps=0.1)
    h = 1e-6
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        fd = np.sum(g * (np_rms_norm(x + e, s, 0.1) - np_rms_norm(x - e, s, 0.1))) / (2 * h)
        assert abs(fd - dx[i]) < 1e-7
    for j in range(7):
        e = np.zeros_like(s)
        e[j] = h
        fd = np.sum(g * (np_rms_norm(x, s + e, 0.1) - np_rms_norm(x, s - e, 0.1))) / (2 * h)
        assert abs(fd - ds[j]) < 1e-7


@pytest.mark.parametrize("case", RMS_NORM_CASES)
def test_reference_kernel_matches_numpy(case):
    shape, dtype = RMS_NORM_CASES[case]
    x, scale, _ = rms_norm_case_arrays(shape, dtype)
    problem = rms_norm_problem(x, scale, eps=RMS_NORM_EPS)
    assert (problem.rows, problem.dim, problem.dtype, problem.scale_dtype) == (
        int(np.prod(shape[:-1])), shape[-1], np.dtype(dtype), np.dtype(np.float32))
    kernel = XlaRMSNorm()
    assert kernel.is_supported(problem)
    check_rms_norm(jax.jit(lambda x, s: kernel(problem, x, s)), shape, dtype)


def test_reference_declines_unknown_extras():
    x, scale, _ = rms_norm_case_arrays((2, 8), jnp.float32)
    support = XlaRMSNorm().is_supported(rms_norm_problem(x, scale, eps=RMS_NORM_EPS, extras={"fp8": True}))
    assert not support and "fp8" in support.reason


def _former_forward(x, scale, eps):
    """RMSNorm.forward before the op existed, verbatim: the op must not change a bit of it."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _norm(registries, **fields):
    layer = RMSNorm.default_config().set(input_dim=96, **fields).instantiate(name="norm", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_through_the_op_is_bit_identical_to_the_former_forward(dtype, registries):
    layer, params = _norm(registries, eps=1e-5)
    x, scale, g = rms_norm_case_arrays((4, 9, 96), dtype)
    params = {"scale": scale}

    def through_layer(x, p):
        return functional(layer, p, (x,), None, True)[0]

    with record_kernel_choices() as choices:
        y, vjp = jax.vjp(jax.jit(through_layer), x, params)
    assert choices == {"rms_norm": {"xla": ["norm"]}}
    y0, vjp0 = jax.vjp(jax.jit(lambda x, p: _former_forward(x, p["scale"], 1e-5)), x, params)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))
    for got, want in zip(jax.tree.leaves(vjp(g)), jax.tree.leaves(vjp0(g))):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


class DoublingNorm:
    """An `rms_norm` kernel returning twice the reference, below it in priority (runs only when forced)."""

    name = "doubling"
    priority = -1

    def __init__(self):
        self.sites = []

    def is_supported(self, problem):
        return unknown_extras(problem)

    def __call__(self, problem, x, scale):
        self.sites.append(problem.site)
        return 2 * XlaRMSNorm()(problem, x, scale)


class NormPlugin:
    def __init__(self, kernel):
        self.kernel = kernel

    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register("rms_norm", self.kernel)


def test_kernels_setting_forces_an_rms_norm_kernel_and_extras_reach_the_problem():
    kernel = DoublingNorm()
    registries = axcore.create_plugin_manager(["norms"], objects={"norms": NormPlugin(kernel)}).registries
    assert [k.name for k in registries.kernels.candidates(RMS_NORM)] == ["xla", "doubling"]
    x, _, _ = rms_norm_case_arrays((3, 96), jnp.float32)
    plain, params = _norm(registries)
    forced, _ = _norm(registries, kernels={"rms_norm": "doubling"})
    y_plain = functional(plain, params, (x,), None, False)[0]
    y_forced = functional(forced, params, (x,), None, False)[0]
    assert kernel.sites == ["norm"]
    np.testing.assert_allclose(y_forced, 2 * y_plain)
    np.testing.assert_allclose(y_plain, np_rms_norm(x, params["scale"]), rtol=1e-5, atol=1e-5)
    with_extras, _ = _norm(registries, op_extras={"rms_norm": {"fp8": True}})
    with pytest.raises(KernelNotSupportedError, match="xla: does not implement extras .'fp8'."):
        functional(with_extras, params, (x,), None, False)
