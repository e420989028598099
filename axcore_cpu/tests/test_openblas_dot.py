"""axcore-cpu's `openblas` dot kernel against NumPy, when it serves, and in the engine's programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.kernels import dot_problem, forward_only_programs

from axcore_cpu import OpenBlasDot, openblas_dot
from axcore_cpu.openblas_dot import sgemm, xla_dot_is_faster


@pytest.fixture(autouse=True)
def serving_here(monkeypatch):
    """The kernel as it serves on a CPU without AVX-512 (on one with, it declines every problem: tested below)."""
    monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: False)


def run(x, w, contract):
    problem = dot_problem(x, w, contract, compute_dtype=np.float32, platform="cpu")
    kernel = OpenBlasDot()
    with forward_only_programs():
        assert kernel.is_supported(problem), kernel.is_supported(problem).reason
        return np.asarray(jax.jit(lambda a, b: kernel(problem, a, b))(jnp.asarray(x), jnp.asarray(w)))


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "contract", "numpy_dot"),
    [
        ((5, 7), (7, 3), (0,), lambda x, w: x @ w),  # A Linear.
        ((2, 3, 8), (8, 4, 6), (0,), lambda x, w: np.einsum("abi,ijk->abjk", x, w)),  # q projection [dim, heads, hd].
        ((4, 2, 3), (2, 3, 5), (0, 1), lambda x, w: np.einsum("bhd,hdo->bo", x, w)),  # Output projection.
        ((3, 6), (11, 6), (1,), lambda x, w: x @ w.T),  # A tied output head [vocab, dim].
        ((1, 9), (9, 4), (0,), lambda x, w: x @ w),  # One row: XLA's matrix-vector product.
        ((0, 9), (9, 4), (0,), lambda x, w: x @ w),  # No rows.
    ],
)
def test_matches_numpy(x_shape, w_shape, contract, numpy_dot):
    rng = np.random.default_rng(len(x_shape) + len(w_shape))
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    want = numpy_dot(x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(run(x, w, contract), want, rtol=1e-5, atol=1e-5)


def test_sgemm_splits_wide_products_over_threads_exactly():
    """A product wide enough to be cut into column parts (run on XLA's threads) equals NumPy's everywhere."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((33, 70)).astype(np.float32), rng.standard_normal((70, 1000)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=False))(x, w))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)
    got_t = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=True))(x, w.T.copy()))
    np.testing.assert_array_equal(got_t.shape, (33, 1000))
    np.testing.assert_allclose(got_t, got, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 3, 7, 8, 9, 16, 17])
def test_products_of_few_and_many_rows_agree_with_numpy(rows):
    """A decode step's few rows and more, both layouts, 1000 columns cut into parts over threads, a contraction
    of 75: within float32 rounding of NumPy's float64."""
    rng = np.random.default_rng(rows)
    x, w = rng.standard_normal((rows, 75)).astype(np.float32), rng.standard_normal((75, 1000)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=False))(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    got_t = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=True))(x, w.T.copy()))
    np.testing.assert_allclose(got_t, want, rtol=1e-5, atol=1e-4)


def test_reads_avx512_from_the_cpu_s_flags():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()  # No such line off x86.
    assert xla_dot_is_faster() == ("avx512f" in flags)  # The real function (the fixture patches the module's name).


def test_vmapped_over_stacked_weights_as_a_mixture_of_experts_does():
    """vmap over a leading expert axis of x and w (one sgemm per expert) equals NumPy's batched product."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 6, 8)).astype(np.float32), rng.standard_normal((3, 8, 5)).astype(np.float32)
    problem = dot_problem(x[0], w[0], (0,), compute_dtype=np.float32, platform="cpu")
    with forward_only_programs():
        got = jax.jit(jax.vmap(lambda a, b: OpenBlasDot()(problem, a, b)))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(got), np.einsum("eti,eio->eto", x.astype(np.float64), w), rtol=1e-5, atol=1e-5)
