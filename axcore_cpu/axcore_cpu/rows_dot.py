"""`cpu_rows`: the `dot` op's kernel for the few rows of the engine's decode steps on an AVX-512 CPU.

XLA:CPU's dot (and every BLAS sgemm) first copies the weight into panels laid out for its
inner loop; at the rows of a decode step (1-32) that copy costs as much as the product.
This kernel, an XLA FFI call into axcore-cpu's library, reads each weight once, in its own
layout and in place (no copy, so it serves the live parameters of a training process as
well as a server's), into accumulators held in vector registers: `w [in, out]` in blocks of
32 of its rows, each thread a contiguous range of them (partial sums added at the end); a
tied head's `[vocab, dim]` rows as dot products, each thread a range of rows. On the 2-core
AVX-512 Xeon of `benchmarks/README.md` the 135M model's projections and head took 0.73-0.84x
XLA's time at 2-32 rows, 0.96x at 1, 1.13x at 64 (`benchmarks/cpu_dot_rows.py`); at more
rows than `MAX_ROWS` XLA's blocked product wins, so there the kernel hands the problem to
XLA's dot (`reference_dot`).

It declines where `openblas` is the CPU's kernel (no AVX-512: measured there, sgemm wins)
and, as `openblas` does, training programs (no backward pass), anything but float32,
weights contracted on neither their leading nor their trailing dims, and meshes of more
than one device.
"""

from __future__ import annotations

import math

import jax

from axcore.kernels import DotProblem, Support, reference_dot, unknown_extras

from axcore_cpu import native, openblas_dot

# Most rows of x the kernel computes itself for a weight `[in, out]` and a tied head `[out, in]`;
# more go to XLA's dot (module docstring).
MAX_ROWS = {"leading": 32, "trailing": 16}


def rows_dot(x: jax.Array, w: jax.Array, *, trans_w: bool) -> jax.Array:
    """float32 `x [m, k] . w` in axcore-cpu's few-rows product: w `[k, n]`, or `[n, k]` with `trans_w` -> `[m, n]`."""
    return openblas_dot.ffi_product(native.ROWS_DOT_TARGET, x, w, trans_w=trans_w)


class CpuRowsDot:
    """The `dot` op for a decode step's few rows on an AVX-512 CPU, forward-only (module docstring)."""

    name = "cpu_rows"
    # Above `openblas` (10) and the reference: where it supports a problem, it runs.
    priority = 20

    def is_supported(self, problem: DotProblem) -> Support:
        if (unsupported := openblas_dot.serving_dot_unsupported(problem)) is not None:
            return unsupported
        if not openblas_dot.xla_dot_is_faster():
            return Support(False, "this CPU has no AVX-512: measured only there (`openblas` serves this CPU)")
        return unknown_extras(problem)

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array) -> jax.Array:
        rows = math.prod(x.shape[: x.ndim - len(problem.contract)])
        if not 0 < rows <= MAX_ROWS[openblas_dot.layout(problem)]:
            return reference_dot(problem, x, w)
        return openblas_dot.flat_product(problem, x, w, rows_dot)
