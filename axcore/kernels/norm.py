"""The `rms_norm` op: `y = x / sqrt(mean(x^2) + eps) * scale` over x's last axis.

Layout: x `[..., dim]` in the compute dtype (any floating dtype), scale `[dim]` in its
storage dtype (float32 master weights by default); y has x's shape and dtype. The
math runs in float32 whatever the dtypes (the dtype policy: norms in float32).

A kernel is called as `kernel(problem, x, scale)` and returns y. The gradients are
those of the formula: with `rstd = 1 / sqrt(mean(x^2) + eps)`, `xhat = x * rstd` and
the output cotangent g (all float32),

    dx     = rstd * (g * scale - xhat * mean(g * scale * xhat, -1))
    dscale = sum over every leading axis of g * xhat

in x's and scale's dtypes.

The reference kernel `xla` (priority 0) is plain jax.numpy differentiated by JAX:
the float32 computation `RMSNorm` always ran, so its outputs and gradients are
bit-identical to before the op existed. JAX's autodiff of it keeps float32 `[..., dim]`
temporaries; hardware plugins register fused kernels (a `jax.custom_vjp` that saves
only x and the row rstd, or a Pallas kernel). Force one on a layer (and everything
below it) with `kernels: {rms_norm: NAME}`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels.registry import Op, Problem, Support, current_platform, unknown_extras


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMSNormProblem(Problem):
    """One RMSNorm call (see the module docstring); `input_specs` are x's and scale's."""

    # Shape of x; its last axis is normalized.
    shape: tuple[int, ...]
    # Dtype of x and y (the compute dtype).
    dtype: np.dtype
    # Stored dtype of scale (its gradient's dtype).
    scale_dtype: np.dtype
    # Added to the mean square before the reciprocal square root.
    eps: float
    # Dotted path of the call site, e.g. "model.decoder.layer0.attention_norm".
    site: str = ""

    @property
    def dim(self) -> int:
        """Size of the normalized (last) axis."""
        return self.shape[-1]

    @property
    def rows(self) -> int:
        """Number of normalized vectors (the product of the leading axes)."""
        return math.prod(self.shape[:-1])


def rms_norm_problem(
    x: Any,
    scale: Any,
    *,
    eps: float,
    site: str = "",
    extras: dict[str, Any] | None = None,
    platform: str | None = None,
    mesh: Any = None,
    input_specs: tuple[Any, ...] = (),
) -> RMSNormProblem:
    """An RMSNormProblem for arrays (or ShapeDtypeStructs) x `[..., dim]` and scale `[dim]`."""
    return RMSNormProblem(
        platform=platform or current_platform(),
        mesh=mesh,
        input_specs=input_specs,
        extras=dict(extras or {}),
        shape=tuple(x.shape),
        dtype=np.dtype(x.dtype),
        scale_dtype=np.dtype(scale.dtype),
        eps=float(eps),
        site=site,
    )


def reference_rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """y `[..., dim]` in x's dtype: the float32 formula, differentiated by JAX."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class XlaRMSNorm:
    """The reference `rms_norm` kernel; supports every problem without extras."""

    name = "xla"
    priority = 0

    def is_supported(self, problem: RMSNormProblem) -> Support:
        return unknown_extras(problem)

    def __call__(self, problem: RMSNormProblem, x: jax.Array, scale: jax.Array) -> jax.Array:
        return reference_rms_norm(x, scale, problem.eps)


RMS_NORM = Op("rms_norm", RMSNormProblem, XlaRMSNorm(), "x / sqrt(mean(x^2, -1) + eps) * scale, in float32.")


__all__ = ["RMS_NORM", "RMSNormProblem", "XlaRMSNorm", "reference_rms_norm", "rms_norm_problem"]
