"""The linear op `y = x @ w`: problem description and its kernels.

Layout: x `[..., input_dim]`, w `[input_dim, output_dim]`, y `[..., output_dim]`.

Two built-in kernels compute the same math:

- `xla` (priority 0, the fallback): `jnp.einsum`, differentiated by JAX.
- `xla_cpu` (priority 10, CPU only): the same forward with a hand-written VJP whose
  weight gradient `dw[i, o] = sum_t x[t, i] g[t, o]` puts the smaller of x and g as
  the dot's left operand. XLA:CPU's dot wants its left operand contracted on the
  minor dimension, so it transposes that operand in memory first; JAX's own rule
  always puts g on the left, which for an up-projection (output_dim > input_dim,
  e.g. an FFN's [2048, 1024] hidden gradient) meant an unvectorized transposing copy
  that took as long as the dot itself (benchmarks/utilization.py's profile). The
  values agree with `xla` up to float rounding.

  Limits of a custom VJP, where `xla` (force it with the layer's `kernel` field) has
  none: forward-mode autodiff (`jax.jvp`, `jax.jacfwd`) raises, and `jax.checkpoint`
  policies that save dots (`dots_saveable`, ...) do not see this op as a dot, so its
  output is recomputed rather than saved.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels.registry import SUPPORTED, Support

LINEAR_OP = "linear"


@dataclasses.dataclass(frozen=True)
class LinearProblem:
    """What a kernel needs to decide whether it can run a linear call."""

    input_dim: int
    output_dim: int
    dtype: np.dtype
    # jax.default_backend() of the computation: "cpu", "gpu", "tpu", ...
    platform: str

    @classmethod
    def of(cls, x, w) -> LinearProblem:
        return cls(w.shape[0], w.shape[1], np.dtype(x.dtype), jax.default_backend())


class XlaLinear:
    """`jnp.einsum("...i,io->...o", x, w)`; supports every problem."""

    name = "xla"
    priority = 0

    def is_supported(self, problem: LinearProblem) -> Support:
        return SUPPORTED

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return _linear(x, w)


class XlaCpuLinear:
    """The `xla` forward with a weight gradient ordered for XLA:CPU (module docstring)."""

    name = "xla_cpu"
    priority = 10

    def is_supported(self, problem: LinearProblem) -> Support:
        if problem.platform != "cpu":
            return Support(False, f"only for the cpu platform, not {problem.platform}")
        return SUPPORTED

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return _linear_cpu(x, w)


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,io->...o", x, w)


_linear_cpu = jax.custom_vjp(_linear)


def _linear_cpu_fwd(x, w):
    return _linear(x, w), (x, w)


def _linear_cpu_bwd(residuals, g):
    x, w = residuals
    dx = jnp.einsum("...o,io->...i", g, w).astype(x.dtype)
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    tokens = (((0,), (0,)), ((), ()))  # Contract the flattened leading dimensions.
    if x2.shape[1] <= g2.shape[1]:  # x is the smaller operand: XLA transposes it.
        dw = jax.lax.dot_general(x2, g2, tokens)
    else:  # g is smaller: JAX's usual order, then a transpose of the small [out, in] result.
        dw = jax.lax.dot_general(g2, x2, tokens).T
    return dx, dw.astype(w.dtype)


_linear_cpu.defvjp(_linear_cpu_fwd, _linear_cpu_bwd)
