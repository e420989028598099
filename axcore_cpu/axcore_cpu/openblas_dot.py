"""`openblas`: the `dot` op's kernel for the inference engine's programs on the CPU, through OpenBLAS's sgemm.

On an AVX2 CPU (the 2-core AMD EPYC of `benchmarks/README.md`) XLA:CPU runs a weight matmul
of a few rows (a decode step's) far below what the CPU can do; OpenBLAS's sgemm, called
through an XLA FFI custom call on the same buffers (no copy), ran them about twice as fast.
One row stays with XLA, whose matrix-vector product is faster than sgemm's there. On a CPU
with AVX-512 (the 2-core Xeon of the same file) it is the other way round: XLA's dot took
0.61-0.86x sgemm's time at every row count from 1 to 256 on the 135M model's matrices
(`benchmarks/cpu_dot_rows.py`), so there the kernel declines (`xla_dot_is_faster`).

The kernel has no backward pass, so it serves only programs traced inside
`axcore.kernels.forward_only_programs()` (the engine's `ModelRunner`); training steps
keep XLA's dot. It declines: other platforms, anything but float32 (weights, compute and
output), weights whose contracted dims are neither their leading nor their trailing ones,
meshes of more than one device (a custom call has no sharding rule), unknown extras, and
every problem on a CPU with AVX-512.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels import DotProblem, Support, reference_dot, tracing_forward_only, unknown_extras

from axcore_cpu import native


def layout(problem: DotProblem) -> str | None:
    """"leading" (w `[contracted..., out...]`), "trailing" (w `[out..., contracted...]`), or None."""
    k, ndim = len(problem.contract), len(problem.w_shape)
    if problem.contract == tuple(range(k)):
        return "leading"
    if problem.contract == tuple(range(ndim - k, ndim)):
        return "trailing"
    return None


def ffi_product(target: str, x: jax.Array, w: jax.Array, *, trans_w: bool) -> jax.Array:
    """float32 `x [m, k] . w` through the library's product handler `target`: w `[k, n]`, or `[n, k]` with
    `trans_w` -> `[m, n]`."""
    native.load()
    n = w.shape[0] if trans_w else w.shape[1]
    # Under vmap (e.g. a mixture of experts' per-expert weights) one call per batch element.
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential")
    return call(x, w, trans_w=np.int64(trans_w))


def sgemm(x: jax.Array, w: jax.Array, *, trans_w: bool) -> jax.Array:
    """float32 `x [m, k] . w` through OpenBLAS: w `[k, n]`, or `[n, k]` with `trans_w` -> `[m, n]`."""
    return ffi_product(native.SGEMM_TARGET, x, w, trans_w=trans_w)


def flat_product(problem: DotProblem, x: jax.Array, w: jax.Array, product) -> jax.Array:
    """The dot of `problem` as `product(x2 [rows, in], w2, trans_w=...)` on x and w flattened to 2-D (w2 `[in,
    out]`, or `[out, in]` with `trans_w` for trailing contracted dims), reshaped back to the op's layout."""
    lead = x.shape[: x.ndim - len(problem.contract)]
    trans_w = layout(problem) == "trailing"
    w2 = w.reshape(-1, problem.in_dim) if trans_w else w.reshape(problem.in_dim, -1)
    y = product(x.astype(jnp.float32).reshape(math.prod(lead), problem.in_dim), w2, trans_w=trans_w)
    return y.reshape(*lead, *problem.out_dims)


def serving_dot_unsupported(problem: DotProblem) -> Support | None:
    """Why a 2-D float32 FFI product cannot serve `problem` (not one CPU device, a program that may be
    differentiated, another dtype, contracted dims neither leading nor trailing), or None if it can."""
    if (unsupported := native.ffi_call_unsupported(problem)) is not None:
        return unsupported
    if not tracing_forward_only():
        return Support(False, "no backward pass: only for forward-only programs (the inference engine's)")
    dtypes = {np.dtype(problem.w_dtype), np.dtype(problem.compute_dtype), np.dtype(problem.output_dtype)}
    if dtypes != {np.dtype(np.float32)}:
        return Support(False, f"float32 only, not weights/compute/output {sorted(d.name for d in dtypes)}")
    if layout(problem) is None:
        return Support(False, f"contracts weight dims {problem.contract}, neither its leading nor trailing ones")
    return None


@functools.cache
def xla_dot_is_faster() -> bool:
    """Whether this CPU has AVX-512 (`avx512f` in /proc/cpuinfo), where XLA:CPU's own dot was measured faster than
    sgemm (module docstring); read once, on first use."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512f" in flags


class OpenBlasDot:
    """The `dot` op through OpenBLAS on the CPU, for forward-only programs (module docstring)."""

    name = "openblas"
    # Above the reference: where it supports a problem (the engine's programs on the CPU), it runs.
    priority = 10

    def is_supported(self, problem: DotProblem) -> Support:
        if (unsupported := serving_dot_unsupported(problem)) is not None:
            return unsupported
        if xla_dot_is_faster():
            return Support(False, "this CPU has AVX-512, where XLA's own dot was measured faster than sgemm")
        return unknown_extras(problem)

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array) -> jax.Array:
        if math.prod(x.shape[: x.ndim - len(problem.contract)]) <= 1:  # XLA's matrix-vector product beats sgemm.
            return reference_dot(problem, x, w)
        return flat_product(problem, x, w, sgemm)
