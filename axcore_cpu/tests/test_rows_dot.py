"""axcore-cpu's `cpu_rows` dot kernel against NumPy, when it serves, and in the engine's programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.kernels import dot_problem, forward_only_programs

from axcore_cpu import CpuRowsDot, openblas_dot, rows_dot
from axcore_cpu.rows_dot import MAX_ROWS


@pytest.fixture(autouse=True)
def serving_here(monkeypatch):
    """The kernel as it serves on a CPU with AVX-512 (on one without, it declines: tested below). The product
    itself runs on any x86-64 CPU (8 float lanes without AVX-512, 16 with)."""
    monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: True)


def product(x, w, trans_w):
    return np.asarray(jax.jit(lambda a, b: rows_dot.rows_dot(a, b, trans_w=trans_w))(x, w))


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 32, 33])
@pytest.mark.parametrize(("k", "n"), [(75, 1000), (576, 192), (33, 70), (16, 64), (7, 3)])
def test_both_layouts_agree_with_numpy(rows, k, n):
    """Tiles of 1-6 rows and their remainders, column panels and the columns past the last whole one, blocks of
    32 rows of w and a contraction that is no multiple of the vector width, columns split into parts over
    threads (n >= 128): within float32 rounding of NumPy's float64."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    x, w = rng.standard_normal((rows, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(product(x, w, False), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(product(x, np.ascontiguousarray(w.T), True), want, rtol=1e-5, atol=1e-4)


def test_no_rows_and_no_columns():
    assert product(np.zeros((0, 8), np.float32), np.ones((8, 4), np.float32), False).shape == (0, 4)
    assert product(np.ones((3, 8), np.float32), np.ones((8, 0), np.float32), False).shape == (3, 0)


def run(x, w, contract):
    """The kernel on (x, w) in a jitted forward-only program: (result, whether the FFI call is in its HLO)."""
    problem = dot_problem(x, w, contract, compute_dtype=np.float32, platform="cpu")
    kernel = CpuRowsDot()
    with forward_only_programs():
        assert kernel.is_supported(problem), kernel.is_supported(problem).reason
        fn = jax.jit(lambda a, b: kernel(problem, a, b))
        hlo = fn.lower(jnp.asarray(x), jnp.asarray(w)).as_text()
        return np.asarray(fn(jnp.asarray(x), jnp.asarray(w))), "axcore_cpu_rows_dot" in hlo


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "contract", "numpy_dot", "ffi"),
    [
        ((5, 7), (7, 3), (0,), lambda x, w: x @ w, True),  # A Linear.
        ((2, 3, 8), (8, 4, 6), (0,), lambda x, w: np.einsum("abi,ijk->abjk", x, w), True),  # q projection.
        ((4, 2, 3), (2, 3, 5), (0, 1), lambda x, w: np.einsum("bhd,hdo->bo", x, w), True),  # Output projection.
        ((3, 6), (11, 6), (1,), lambda x, w: x @ w.T, True),  # A tied output head [vocab, dim].
        ((MAX_ROWS["leading"] + 1, 9), (9, 4), (0,), lambda x, w: x @ w, False),  # Too many rows: XLA's dot.
        ((MAX_ROWS["trailing"] + 1, 6), (11, 6), (1,), lambda x, w: x @ w.T, False),
        ((0, 9), (9, 4), (0,), lambda x, w: x @ w, False),  # No rows.
    ],
)
def test_the_kernel_matches_numpy_and_hands_many_rows_to_xla(x_shape, w_shape, contract, numpy_dot, ffi):
    rng = np.random.default_rng(len(x_shape) + len(w_shape))
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    got, called = run(x, w, contract)
    np.testing.assert_allclose(got, numpy_dot(x.astype(np.float64), w.astype(np.float64)), rtol=1e-5, atol=1e-5)
    assert called == ffi


def test_vmapped_over_stacked_weights_as_a_mixture_of_experts_does():
    """vmap over a leading expert axis of x and w (one call per expert) equals NumPy's batched product."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 6, 8)).astype(np.float32), rng.standard_normal((3, 8, 5)).astype(np.float32)
    got = jax.jit(jax.vmap(lambda a, b: rows_dot.rows_dot(a, b, trans_w=False)))(x, w)
    np.testing.assert_allclose(np.asarray(got), np.einsum("eik,ekn->ein", x, w), rtol=1e-5, atol=1e-5)
