"""The `dot` op: every weight matmul of every layer, `y = x . w`.

Layout: x `[..., c_1, ..., c_k]` (its last k dims are contracted), w of any rank whose
dims `contract = (a_1, ..., a_k)` match x's last k dims in order; y is x's leading
dims followed by w's remaining dims in order. A Linear is `contract=(0,)` on
`[in, out]`; attention's q projection is `[dim, heads, head_dim]` with `(0,)`, its
output projection `[heads, head_dim, dim]` with `(0, 1)`; a tied output head is the
embedding table `[vocab, dim]` with `(1,)`.

Mixed precision lives here: the problem says the weight's stored dtype, the compute
dtype both operands are cast to, and the output dtype (float32 for logits), so a
quantizing kernel sees the float32 master weight and chooses its own arithmetic.

Two built-in kernels compute the same math:

- `xla` (the op's reference, priority 0): `lax.dot_general`, differentiated by JAX.
- `xla_cpu` (opt-in: priority -10, below the reference, so it runs only where a layer's
  `kernels: {dot: xla_cpu}` asks for it; CPU only, leading-dims contractions): the same forward on the
  operands flattened to 2-D, with a hand-written VJP whose weight gradient
  `dw[i, o] = sum_t x[t, i] g[t, o]` puts the smaller of x and g as the dot's left
  operand. XLA:CPU's dot wants its left operand contracted on the minor dimension,
  so it transposes that operand in memory first; JAX's own rule always puts g on the
  left, which for an up-projection (e.g. an FFN's [2048, 1024] hidden gradient) meant
  an unvectorized transposing copy as long as the dot itself. Limits of a custom VJP:
  forward-mode autodiff (`jax.jvp`) raises, and `jax.checkpoint` policies that save
  dots do not see it as a dot. It changes more than speed, so it is not the default
  (it was until issue 23); the default CPU step is about 1.36x faster with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels.registry import Op, Problem, Support, current_platform, unknown_extras


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotProblem(Problem):
    """One weight matmul (see the module docstring for the layout)."""

    # Shape of the weight as stored.
    w_shape: tuple[int, ...]
    # Weight dims contracted with x's last len(contract) dims, in order.
    contract: tuple[int, ...]
    # Stored dtype of the weight (float32 master weights by default).
    w_dtype: np.dtype
    # Both operands are cast to this before multiplying.
    compute_dtype: np.dtype
    # Dtype of the result (float32 for logits, else the compute dtype).
    output_dtype: np.dtype
    # Logical axis names of the weight's dims (None entries: replicated).
    w_axes: tuple[str | None, ...] | None = None
    # Dotted path of the call site, e.g. "model.decoder.layer0.self_attention.q_proj".
    site: str = ""

    @property
    def in_dim(self) -> int:
        return math.prod(self.w_shape[a] for a in self.contract)

    @property
    def out_dims(self) -> tuple[int, ...]:
        return tuple(d for a, d in enumerate(self.w_shape) if a not in self.contract)


def reference_dot(problem: DotProblem, x: jax.Array, w: jax.Array) -> jax.Array:
    """`lax.dot_general` of x and w cast to the compute dtype, accumulated into the output dtype."""
    x = x.astype(problem.compute_dtype)
    w = w.astype(problem.compute_dtype)
    k = len(problem.contract)
    dims = ((tuple(range(x.ndim - k, x.ndim)), problem.contract), ((), ()))
    contract = functools.partial(jax.lax.dot_general, dimension_numbers=dims)
    return wide_result(contract, x, w, problem.output_dtype)


def wide_result(contract: Callable[..., jax.Array], a: jax.Array, b: jax.Array, out_dtype: Any) -> jax.Array:
    """`contract(a, b)` (a dot or einsum taking `preferred_element_type`) accumulated and returned in
    `out_dtype`, whose backward pass multiplies in the operands' dtype.

    For float32 logits from bfloat16 operands JAX's own rule differentiates with the
    float32 cotangent against a bfloat16 operand, which XLA upcasts: the output
    head's and attention scores' backward matmuls then run in float32 (measured on an
    H100: cuBLAS f32 GEMMs). Here the cotangent is rounded to the operands' dtype
    first, as the forward's inputs were, so every matmul of the step runs in
    bfloat16 with float32 accumulation. With operands already in `out_dtype` this
    is plain `contract(a, b)`.
    """
    out_dtype = np.dtype(out_dtype)
    if np.dtype(a.dtype) == out_dtype and np.dtype(b.dtype) == out_dtype:
        return contract(a, b, preferred_element_type=out_dtype)
    return _wide_result(contract, out_dtype, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _wide_result(contract, out_dtype, a, b):
    return contract(a, b, preferred_element_type=out_dtype).astype(out_dtype)


def _wide_result_fwd(contract, out_dtype, a, b):
    return _wide_result(contract, out_dtype, a, b), (a, b)


def _wide_result_bwd(contract, out_dtype, residuals, g):
    a, b = residuals
    g = g.astype(a.dtype)
    # Transposes of the bilinear map in each operand (no forward recomputation).
    (da,) = jax.linear_transpose(lambda a_: contract(a_, b, preferred_element_type=a.dtype), a)(g)
    (db,) = jax.linear_transpose(lambda b_: contract(a, b_, preferred_element_type=a.dtype), b)(g)
    return da, db


_wide_result.defvjp(_wide_result_fwd, _wide_result_bwd)


class XlaDot:
    """The reference `dot` kernel; supports every problem without extras."""

    name = "xla"
    priority = 0

    def is_supported(self, problem: DotProblem) -> Support:
        return unknown_extras(problem)

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array) -> jax.Array:
        return reference_dot(problem, x, w)


class XlaCpuDot:
    """The `xla` forward with a weight gradient ordered for XLA:CPU (module docstring)."""

    name = "xla_cpu"
    priority = -10  # Opt-in (module docstring).

    def is_supported(self, problem: DotProblem) -> Support:
        if problem.platform != "cpu":
            return Support(False, f"only for the cpu platform, not {problem.platform}")
        if problem.contract != tuple(range(len(problem.contract))):
            return Support(False, "contracts dims other than the weight's leading ones")
        return unknown_extras(problem)

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array) -> jax.Array:
        k = len(problem.contract)
        lead = x.shape[: x.ndim - k]
        x2 = x.astype(problem.compute_dtype).reshape(math.prod(lead), problem.in_dim)
        w2 = w.astype(problem.compute_dtype).reshape(problem.in_dim, -1)
        y = _dot_cpu(x2, w2, problem.output_dtype)
        return y.reshape(*lead, *problem.out_dims)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dot_cpu(x: jax.Array, w: jax.Array, out_dtype: np.dtype) -> jax.Array:
    """x `[n, i]` @ w `[i, o]`, accumulated and returned in `out_dtype` (float32 logits stay float32)."""
    return jax.lax.dot(x, w, preferred_element_type=out_dtype).astype(out_dtype)


def _dot_cpu_fwd(x, w, out_dtype):
    return _dot_cpu(x, w, out_dtype), (x, w)


def _dot_cpu_bwd(out_dtype, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)  # The backward dots run in the compute dtype, like the forward one.
    dx = jax.lax.dot(g, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    tokens = (((0,), (0,)), ((), ()))  # Contract the token dimension.
    if x.shape[1] <= g.shape[1]:  # x is the smaller operand: XLA transposes it.
        dw = jax.lax.dot_general(x, g, tokens, preferred_element_type=jnp.float32)
    else:  # g is smaller: JAX's usual order, then a transpose of the small [o, i] result.
        dw = jax.lax.dot_general(g, x, tokens, preferred_element_type=jnp.float32).T
    return dx, dw.astype(w.dtype)


_dot_cpu.defvjp(_dot_cpu_fwd, _dot_cpu_bwd)

DOT = Op("dot", DotProblem, XlaDot(), "y = x . w over x's trailing dims and w's `contract` dims.")


def dot_problem(
    x: Any,
    w: Any,
    contract: tuple[int, ...],
    *,
    compute_dtype: Any,
    output_dtype: Any = None,
    w_axes: tuple[str | None, ...] | None = None,
    site: str = "",
    extras: dict[str, Any] | None = None,
    platform: str | None = None,
    mesh: Any = None,
    input_specs: tuple[Any, ...] = (),
) -> DotProblem:
    """A DotProblem for arrays (or ShapeDtypeStructs) x and w."""
    compute = np.dtype(compute_dtype)
    return DotProblem(
        platform=platform or current_platform(),
        mesh=mesh,
        input_specs=input_specs,
        extras=dict(extras or {}),
        w_shape=tuple(w.shape),
        contract=tuple(contract),
        w_dtype=np.dtype(w.dtype),
        compute_dtype=compute,
        output_dtype=np.dtype(output_dtype) if output_dtype is not None else compute,
        w_axes=w_axes,
        site=site,
    )


__all__ = ["DOT", "DotProblem", "XlaCpuDot", "XlaDot", "dot_problem", "reference_dot"]
