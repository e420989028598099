"""An fp8 `dot` kernel with per-tensor delayed scaling (Ada/Hopper and newer; CPU emulation).

Arithmetic (the recipe of TransformerEngine's and Flax's fp8 matmuls, per tensor):

- Forward: x and the weight (its float32 master value cast to the compute dtype) are
  each quantized to float8_e4m3fn with a per-tensor scale,

      q(v, s) = clip(v / s, -max, max).astype(fp8),

  multiplied as fp8 arrays with float32 accumulation, and the product scaled by
  `s_x * s_w` into the site's output dtype: `y = (q(x) . q(w)) * s_x * s_w`, which is
  the dot of the dequantized values (the scales are scalars). The dot's operands are
  fp8 in the program itself, so on a GPU it is one cuBLASLt fp8 GEMM
  (`__cublas$lt$matmul$f8`) whatever else XLA fuses; on CPU it is an emulation with the
  same numerics. (The dequantize-then-dot form, `dot(q(x).astype(bf16) * s_x, ...)`,
  which XLA's GemmRewriter documents, compiled on an H200 with JAX 0.11.2 into Triton
  bf16 GEMMs whose fp8 round trip XLA had removed: bf16 numerics, no fp8 tensor cores;
  `benchmarks/gpu_probes.py` shows both.)
- Backward: the output gradient g is quantized to float8_e5m2 (more range, less
  precision), then `dx = (q(g) . q(w)^T) * s_g * s_w` and `dw = (q(x)^T . q(g)) * s_x * s_g`
  (e5m2 x e4m3 and e4m3 x e5m2, the pairs cuBLASLt takes), float32 accumulated; the
  quantization is straight-through. The residuals kept for the backward pass are the
  fp8 operands (a quarter of float32's memory). The gradient reaches the float32 master
  weight through the cast, as for any `dot`.
- Delayed scaling: each of x, w and g has an amax history (float32 `[history_length]`,
  newest first) kept as kernel state under `kernel_state/<site>`. A step's scale is
  `s = max(history) / fp8_max * 2**margin` over the history *before* the step (1.0 while
  it is all zero, i.e. on the first step, or not finite); the step's own amax is then
  pushed (the history rolls by one, the current amax at index 0). x's and w's new
  histories are the kernel's forward `new_state`; g's amax is only known in the
  backward pass, so `g_amax_history` is declared `overwrite_with_gradient=True` and
  the custom VJP returns its new history as its cotangent, which the train step
  stores as its value. Every site is used exactly once per step (a step that skips a
  site would zero its g history, one that used it twice would sum two histories).

Declines (`is_supported`, with the reason): a GPU below compute capability 8.9 (no
fp8 tensor cores) or with no CUDA device; platforms other than gpu and cpu; sites
whose output dtype differs from the compute dtype (the float32 logits of the output
head stay in higher precision); a compute dtype other than float32, bfloat16 or
float16; a contracted size or output size (the flattened GEMM's K and N) that is not a
multiple of 16, as cuBLASLt fp8 needs (this also declines small MoE routers); extras
it does not know. In an all-float32 model the output head's output dtype equals the
compute dtype, so it is not declined: force `kernels: {dot: xla}` on it if wanted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels import DotProblem, Support, unknown_extras
from axcore.params import ParameterSpec, constant

from axcore_gpu.devices import cuda_compute_capability

# Forward operands and their gradients' dtypes.
FORWARD_DTYPE = np.dtype(jnp.float8_e4m3fn)
GRADIENT_DTYPE = np.dtype(jnp.float8_e5m2)
E4M3_MAX = float(jnp.finfo(FORWARD_DTYPE).max)  # 448
E5M2_MAX = float(jnp.finfo(GRADIENT_DTYPE).max)  # 57344
# Lowest CUDA compute capability with fp8 tensor cores (Ada sm89; Hopper is sm90).
MIN_COMPUTE_CAPABILITY = (8, 9)
# cuBLASLt fp8 GEMMs need K and N (and M, which XLA pads) to be multiples of 16.
DIM_MULTIPLE = 16
# Compute dtypes in which every fp8 value is exact.
COMPUTE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
STATE_NAMES = ("x_amax_history", "w_amax_history", "g_amax_history")


def scale_from_history(history: jax.Array, fp8_max: float, margin: int = 0) -> jax.Array:
    """The float32 dequantization scale `max(history) / fp8_max * 2**margin`; 1.0 for an empty (zero) history."""
    amax = jnp.max(history.astype(jnp.float32))
    ok = jnp.logical_and(amax > 0, jnp.isfinite(amax))
    return jnp.where(ok, amax / fp8_max * (2.0**margin), 1.0).astype(jnp.float32)


def push_amax(history: jax.Array, value: jax.Array) -> jax.Array:
    """The history rolled by one with `amax(|value|)` (float32) at index 0."""
    amax = jnp.max(jnp.abs(jax.lax.stop_gradient(value).astype(jnp.float32)))
    return jnp.roll(history, 1).at[0].set(amax.astype(history.dtype))


def quantize(v: jax.Array, scale: jax.Array, fp8_dtype: Any, compute_dtype: Any) -> jax.Array:
    """`clip(v / scale, -max, max).astype(fp8_dtype)`, the division in the compute dtype."""
    fp8_max = float(jnp.finfo(fp8_dtype).max)
    s = scale.astype(compute_dtype)
    return jnp.clip(v.astype(compute_dtype) / s, -fp8_max, fp8_max).astype(fp8_dtype)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static part of one call: the dot's dimension numbers and dtypes (hashable).

    Its products take fp8 operands and return float32 (accumulated in float32), unscaled.
    """

    # Weight dims contracted with x's trailing dims, in order.
    contract: tuple[int, ...]
    # Rank of the weight.
    w_ndim: int
    output_dtype: np.dtype
    compute_dtype: np.dtype
    # Scale margin in powers of two (of the gradient's scale, in the backward pass).
    margin: int

    def forward(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x . w over x's trailing dims and w's `contract` dims (`reference_dot`'s dimensions), f32 accumulated."""
        k = len(self.contract)
        dims = ((tuple(range(x.ndim - k, x.ndim)), self.contract), ((), ()))
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

    def free(self) -> tuple[int, ...]:
        return tuple(a for a in range(self.w_ndim) if a not in self.contract)

    def dx(self, g: jax.Array, w: jax.Array) -> jax.Array:
        """`g . w^T`: g `[lead..., free...]` against w's free dims -> `[lead..., contract...]` (x's layout)."""
        free, lead = self.free(), g.ndim - len(self.free())
        out = jax.lax.dot_general(
            g, w, ((tuple(range(lead, g.ndim)), free), ((), ())), preferred_element_type=jnp.float32
        )
        # w's remaining (contracted) dims come out in ascending order; x has them in `contract` order.
        ascending = sorted(self.contract)
        perm = (*range(lead), *(lead + ascending.index(a) for a in self.contract))
        return jnp.transpose(out, perm)

    def dw(self, x: jax.Array, g: jax.Array) -> jax.Array:
        """`x^T . g` over the leading (token) dims -> the weight's layout."""
        k = len(self.contract)
        lead = tuple(range(x.ndim - k))
        out = jax.lax.dot_general(x, g, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
        # out is `[contract..., free...]`; put each dim at its weight axis.
        free = self.free()
        perm = tuple(self.contract.index(a) if a in self.contract else k + free.index(a) for a in range(self.w_ndim))
        return jnp.transpose(out, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_matmul(layout: _Layout, x, w, x_scale, w_scale, g_history):
    """The fp8 dot of x and w (both in the compute dtype) at the given scales.

    Differentiable in x and w (e5m2 gradients scaled from `g_history`); the cotangent
    of `g_history` is its new value (overwrite-with-gradient), those of the scales zero.
    """
    return _forward(layout, x, w, x_scale, w_scale)[0]


def _forward(layout, x, w, x_scale, w_scale):
    xq = quantize(x, x_scale, FORWARD_DTYPE, layout.compute_dtype)
    wq = quantize(w, w_scale, FORWARD_DTYPE, layout.compute_dtype)
    y = layout.forward(xq, wq) * (x_scale * w_scale)
    return y.astype(layout.output_dtype), xq, wq


def _fp8_matmul_fwd(layout, x, w, x_scale, w_scale, g_history):
    y, xq, wq = _forward(layout, x, w, x_scale, w_scale)
    return y, (xq, wq, x_scale, w_scale, g_history)


def _fp8_matmul_bwd(layout, residuals, g):
    xq, wq, x_scale, w_scale, g_history = residuals
    g_scale = scale_from_history(g_history, E5M2_MAX, layout.margin)
    gq = quantize(g, g_scale, GRADIENT_DTYPE, layout.compute_dtype)
    compute = layout.compute_dtype
    dx = (layout.dx(gq, wq) * (g_scale * w_scale)).astype(compute)
    dw = (layout.dw(xq, gq) * (x_scale * g_scale)).astype(compute)
    new_g_history = push_amax(g_history, g)
    return dx, dw, jnp.zeros_like(x_scale), jnp.zeros_like(w_scale), new_g_history


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


class Fp8Dot:
    """fp8 `dot` with per-tensor delayed scaling (module docstring: arithmetic, state, declines).

    Args:
        history_length: length of each amax history (steps whose maximum sets the scale).
        margin: the scales' margin in powers of two (a margin m leaves 2**m of headroom).
        compute_capability: `(major, minor)` of the target GPU; None = read from the
            devices of the problem's mesh (or the process's) at `is_supported` time.
    """

    name = "fp8"
    priority = 50

    def __init__(self, history_length: int = 16, margin: int = 0, compute_capability: tuple[int, int] | None = None):
        if history_length < 1:
            raise ValueError(f"history_length must be at least 1, got {history_length}.")
        self.history_length = int(history_length)
        self.margin = int(margin)
        self.compute_capability = tuple(compute_capability) if compute_capability is not None else None

    def is_supported(self, problem: DotProblem) -> Support:
        if problem.platform == "gpu":
            capability = self.compute_capability or cuda_compute_capability(problem.mesh)
            if capability is None:
                return Support(False, "no CUDA device to compile fp8 GEMMs for (set compute_capability)")
            if tuple(capability) < MIN_COMPUTE_CAPABILITY:
                major, minor = capability
                reason = f"fp8 tensor cores need compute capability 8.9+ (Ada/Hopper), got {major}.{minor}"
                return Support(False, reason)
        elif problem.platform != "cpu":
            return Support(False, f"runs on CUDA gpus (sm89+) or as a cpu emulation, not on {problem.platform}")
        compute, output = np.dtype(problem.compute_dtype), np.dtype(problem.output_dtype)
        if output != compute:
            return Support(False, f"keeps logits in higher precision (output {output.name}, compute {compute.name})")
        if compute not in COMPUTE_DTYPES:
            return Support(False, f"compute dtype {compute.name} is not float32, bfloat16 or float16")
        out_size = math.prod(problem.out_dims)
        if problem.in_dim % DIM_MULTIPLE or out_size % DIM_MULTIPLE:
            return Support(
                False,
                f"contracted size {problem.in_dim} and output size {out_size} must be multiples of "
                f"{DIM_MULTIPLE} for cuBLASLt fp8",
            )
        return unknown_extras(problem)

    def state_specs(self, problem: DotProblem) -> dict[str, ParameterSpec]:
        del problem
        specs = {}
        for name in STATE_NAMES:
            specs[name] = ParameterSpec(
                (self.history_length,),
                np.float32,
                constant(0.0),
                mesh_axes=(None,),
                weight_decay_scale=0.0,
                trainable=False,
                overwrite_with_gradient=name == "g_amax_history",
            )
        return specs

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array, *, state: dict) -> tuple[jax.Array, dict]:
        compute = np.dtype(problem.compute_dtype)
        layout = _Layout(problem.contract, len(problem.w_shape), np.dtype(problem.output_dtype), compute, self.margin)
        xc, wc = x.astype(compute), w.astype(compute)
        x_history = jax.lax.stop_gradient(state["x_amax_history"])
        w_history = jax.lax.stop_gradient(state["w_amax_history"])
        x_scale = scale_from_history(x_history, E4M3_MAX, self.margin)
        w_scale = scale_from_history(w_history, E4M3_MAX, self.margin)
        # g's history enters the custom VJP as is: its cotangent is its new value.
        y = fp8_matmul(layout, xc, wc, x_scale, w_scale, state["g_amax_history"])
        new_state = {"x_amax_history": push_amax(x_history, xc), "w_amax_history": push_amax(w_history, wc)}
        return y, new_state


__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "Fp8Dot",
    "fp8_matmul",
    "push_amax",
    "quantize",
    "scale_from_history",
]
