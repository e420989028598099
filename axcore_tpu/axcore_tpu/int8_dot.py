"""An int8 `dot` kernel: per-channel weight scales, per-token dynamic activation scales, bfloat16 gradients.

Arithmetic of `y = x . w` (layouts of `axcore.kernels.dot`; below in the 2-D form the
kernel uses, x `[M, K]` with M tokens and K the contracted size, w `[K, N]` with N the
output channels: w's contracted dims first, in `contract` order, its other dims flattened):

- Weights, per output channel n (symmetric): `s_w[n] = max_k |w[k, n]| / 127` from the
  float32 master weight (1 for an all-zero channel), `w_q = clip(round(w / s_w), -127, 127)`
  as int8. Quantized afresh every step (no state): the master weight moves.
- Activations, per token m (dynamic, symmetric): `s_x[m] = max_k |x[m, k]| / 127`,
  `x_q = clip(round(x / s_x), -127, 127)` as int8; x is first cast to float32 (exact for
  bfloat16), the scale and the division are float32, round half to even.
- `y_int = x_q . w_q` int8 x int8 with int32 accumulation
  (`preferred_element_type=int32`: on TPU the MXU's int8 path), exact while
  127 * 127 * K < 2**31, i.e. K <= 133,144 (larger K is declined).
- `y = float32(y_int) * (s_x[m] * s_w[n])`, cast to the output dtype.
- Backward (custom VJP, straight-through for the rounding: the quantizers' derivative is
  taken as 1): with g the output gradient, `dx = g . w^T` and `dw = x^T . g`, both with
  bfloat16 operands (g, x and the master weight rounded to bfloat16) and float32
  accumulation; dx comes back in x's dtype, dw in the master weight's (float32). The
  forward's quantization error is not in the gradient; the bfloat16 rounding of the
  operands is (about 0.2% relative, see the tests).

Where it runs (`is_supported`, each decline with its reason): platform tpu, and cpu as
a numerics emulation (XLA:CPU runs the same int8 x int8 -> int32 dot, without the
speed); other platforms declined. Declined too: an output dtype other than the compute
dtype (the output head's float32 logits keep the regular kernel), compute dtypes other
than float32 and bfloat16, on tpu a contracted size or output size that is not a
multiple of 128 (the MXU's tile: smaller sites, e.g. a MoE router, are not worth it),
K over 133,144 (int32 overflow), and extras it does not know.

Importing this module touches no device and compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels import DotProblem, Support, unknown_extras

INT8_MAX = 127
# Largest contracted size whose int32 accumulation of int8 products cannot overflow.
MAX_CONTRACTED = (2**31 - 1) // (INT8_MAX * INT8_MAX)
# The MXU tile edge: on TPU, K and N must be multiples of it.
TPU_DIM_MULTIPLE = 128
COMPUTE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
GRADIENT_DTYPE = jnp.bfloat16


def quantize(v: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """`(int8 values, float32 scales)` of v quantized symmetrically along `axis` (the scales keep it, size 1)."""
    v32 = v.astype(jnp.float32)
    amax = jnp.max(jnp.abs(v32), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / np.float32(INT8_MAX), np.float32(1.0))
    q = jnp.clip(jnp.round(v32 / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def int8_product(x2: jax.Array, w2: jax.Array, output_dtype) -> jax.Array:
    """The quantized product of x `[M, K]` and w `[K, N]` (module docstring), in `output_dtype`."""
    xq, sx = quantize(x2, axis=1)  # Per token: sx [M, 1].
    wq, sw = quantize(w2, axis=0)  # Per output channel: sw [1, N].
    acc = jax.lax.dot(xq, wq, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * (sx * sw)).astype(output_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def int8_matmul(x2: jax.Array, w2: jax.Array, output_dtype) -> jax.Array:
    """`int8_product`, differentiable straight-through with bfloat16 gradient matmuls."""
    return int8_product(x2, w2, output_dtype)


def _int8_matmul_fwd(x2, w2, output_dtype):
    # Residuals in bfloat16: all the backward matmuls need (and half a float32 weight's memory).
    residuals = (x2.astype(GRADIENT_DTYPE), w2.astype(GRADIENT_DTYPE), jnp.zeros((), x2.dtype), jnp.zeros((), w2.dtype))
    return int8_product(x2, w2, output_dtype), residuals


def _int8_matmul_bwd(output_dtype, residuals, g):
    x16, w16, x_like, w_like = residuals
    g16 = g.astype(GRADIENT_DTYPE)
    dx = jax.lax.dot(g16, w16.T, preferred_element_type=jnp.float32)
    dw = jax.lax.dot_general(x16, g16, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


int8_matmul.defvjp(_int8_matmul_fwd, _int8_matmul_bwd)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a call's x and w become the 2-D `[M, K]` and `[K, N]` operands, and back."""

    # Weight dims contracted with x's trailing dims, in order.
    contract: tuple[int, ...]
    w_shape: tuple[int, ...]

    @property
    def free(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.w_shape)) if a not in self.contract)

    @property
    def k(self) -> int:
        return math.prod(self.w_shape[a] for a in self.contract)

    def x_matrix(self, x: jax.Array) -> jax.Array:
        return x.reshape(-1, self.k)

    def w_matrix(self, w: jax.Array) -> jax.Array:
        return jnp.transpose(w, (*self.contract, *self.free)).reshape(self.k, -1)

    def output(self, y2: jax.Array, x: jax.Array) -> jax.Array:
        lead = x.shape[: x.ndim - len(self.contract)]
        return y2.reshape(*lead, *(self.w_shape[a] for a in self.free))


class Int8Dot:
    """int8 `dot` with per-channel weight and per-token activation scales (module docstring).

    Args:
        priority: selection priority: 50 (the `int8` plugin: before the reference kernels
            wherever it supports the call), or below 0 to make it available by name only
            (the `tpu` plugin's registration, used through the `int8_dot` config modifier).
    """

    name = "int8"
    priority = 50

    def __init__(self, priority: int = 50):
        self.priority = priority

    def is_supported(self, problem: DotProblem) -> Support:
        if problem.platform not in ("tpu", "cpu"):
            return Support(False, f"runs on tpu (or as a cpu emulation), not on {problem.platform}")
        compute, output = np.dtype(problem.compute_dtype), np.dtype(problem.output_dtype)
        if output != compute:
            return Support(False, f"keeps logits in higher precision (output {output.name}, compute {compute.name})")
        if compute not in COMPUTE_DTYPES:
            return Support(False, f"compute dtype {compute.name} is not float32 or bfloat16")
        out_size = math.prod(problem.out_dims)
        if problem.platform == "tpu" and (problem.in_dim % TPU_DIM_MULTIPLE or out_size % TPU_DIM_MULTIPLE):
            return Support(
                False,
                f"contracted size {problem.in_dim} and output size {out_size} must be multiples of "
                f"{TPU_DIM_MULTIPLE} (the TPU MXU tile) on tpu",
            )
        if problem.in_dim > MAX_CONTRACTED:
            return Support(False, f"contracted size {problem.in_dim} > {MAX_CONTRACTED} could overflow int32 sums")
        return unknown_extras(problem)

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array) -> jax.Array:
        layout = Layout(tuple(problem.contract), tuple(problem.w_shape))
        x2 = layout.x_matrix(x.astype(problem.compute_dtype))
        y2 = int8_matmul(x2, layout.w_matrix(w), np.dtype(problem.output_dtype))
        return layout.output(y2, x)


__all__ = ["INT8_MAX", "MAX_CONTRACTED", "Int8Dot", "Layout", "int8_matmul", "int8_product", "quantize"]
