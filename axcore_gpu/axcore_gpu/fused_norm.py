"""Fused kernels of the `rms_norm` op: a closed-form custom VJP, and Pallas (Triton) kernels.

The op (`axcore.kernels.norm`): x `[..., d]` (bf16/f16/f32), scale `[d]`,
`y = x * rstd * scale` with `rstd = 1 / sqrt(mean(x^2) + eps)`, in float32. JAX's
autodiff of the reference keeps float32 `[N, d]` temporaries between the passes; both
kernels here save only x (its own dtype) and rstd (float32, one per row) and use the
closed-form backward, with `xhat = x * rstd` and `gw = g * scale`:

    dx     = rstd * (gw - xhat * mean(gw * xhat, -1))
    dscale = sum over rows of g * xhat                  (float32, cast to scale's dtype)

Kernels (names are what `kernels: {rms_norm: NAME}` forces):

    fused_vjp  `jax.custom_vjp` in jax.numpy, each pass left to XLA's fusion (forward: x
               read, y written; backward: x and g read, dx written, dscale a column sum).
               Any platform, dtype and sharding (XLA partitions it like the reference).
    pallas     Triton kernels, one program per `block_rows` rows with the whole row
               (padded to a power of two, masked) in registers. Forward writes y and rstd;
               backward writes dx and, per program, a float32 partial dscale summed over
               the rows it owns (programs loop over row blocks, at most `max_programs` of
               them), then one small XLA reduction. Declines: platforms other than gpu
               (unless interpret=True), dtypes other than bf16/f16/f32, d > MAX_DIM,
               multi-device meshes (no shard_map wrapper yet), unknown extras.

Measured once on one H100 (JAX 0.11.2; x [16384, 2048] bf16, scale float32; 20 calls chained in
one jit with an optimization barrier between calls; per call, forward / forward+backward with y
materialized): xla 0.053 / 0.205 ms, fused_vjp 0.053 / 0.227 ms, pallas 0.054 / 0.136 ms with the
defaults (2-row tiles, 8 warps, 264 backward programs; 4-row/4-warp and 1-row/4-warp/1024 programs
gave 0.141). The traffic floor (x read, y written; x and g read, dx written) is ~0.04 / ~0.10 ms.
So fused_vjp is no faster than XLA's autodiff of the reference there; the pallas backward is.
Not yet timed inside a train step. The `gpu` plugin registers both below the reference
(priority 0) until they have been timed in the model (see plugin.py), so they run only when forced.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from axcore.kernels import RMSNormProblem, Support, unknown_extras

# Dtypes of x the Pallas kernels take (loaded, then computed in float32).
PALLAS_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
# Largest normalized dim: a whole (power-of-two padded) row of x and g lives in registers.
MAX_DIM = 16384
# Elements of one program's [block_rows, d_pad] tile when block_rows is chosen automatically
# (d 2048: 2 rows, 8 warps; the fastest of those tried on an H100, see the module docstring).
TILE_ELEMENTS = 4096
# Default most programs of the backward: two per SM of an H100 (132 SMs).
MAX_PROGRAMS = 264


# -- fused_vjp: closed-form backward in jax.numpy ----------------------------------------------


def _forward(x, scale, eps):
    """y in x's dtype and rstd `[..., 1]` float32."""
    x32 = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * rstd * scale.astype(jnp.float32)).astype(x.dtype), rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm_fused_vjp(x, scale, eps: float):
    """RMSNorm of x `[..., d]` with scale `[d]`; the VJP saves x and rstd only (module docstring)."""
    return _forward(x, scale, eps)[0]


def _fused_fwd(x, scale, eps):
    y, rstd = _forward(x, scale, eps)
    return y, (x, rstd, scale)


def _fused_bwd(eps, residuals, g):
    x, rstd, scale = residuals
    xhat = x.astype(jnp.float32) * rstd
    g32 = g.astype(jnp.float32)
    gw = g32 * scale.astype(jnp.float32)
    dx = rstd * (gw - xhat * jnp.mean(gw * xhat, axis=-1, keepdims=True))
    dscale = jnp.sum(g32 * xhat, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm_fused_vjp.defvjp(_fused_fwd, _fused_bwd)


class FusedVjpRMSNorm:
    """`rms_norm` as a `jax.custom_vjp` with the closed-form backward (module docstring).

    Args:
        priority: selection priority (the `gpu` plugin registers it below the reference).
    """

    name = "fused_vjp"
    priority = 50

    def __init__(self, *, priority: int = 50):
        self.priority = priority

    def is_supported(self, problem: RMSNormProblem) -> Support:
        return unknown_extras(problem)

    def __call__(self, problem: RMSNormProblem, x: jax.Array, scale: jax.Array) -> jax.Array:
        return rms_norm_fused_vjp(x, scale, problem.eps)


# -- pallas: Triton kernels ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Static description of one call of the Pallas kernels on x reshaped to `[n, d]`."""

    n: int  # Rows.
    d: int  # Normalized dim; rows are padded (masked) to d_pad, a power of two.
    d_pad: int
    eps: float
    block_rows: int  # Rows per tile (a power of two).
    blocks: int  # Row tiles: the forward's grid.
    programs: int  # The backward's grid; program p owns tiles [p * per_program, (p + 1) * per_program).
    per_program: int
    num_warps: int
    interpret: bool

    @classmethod
    def of(cls, n: int, d: int, eps: float, *, block_rows, num_warps, max_programs, interpret) -> NormConfig:
        d_pad = pl.next_power_of_2(d)
        block_rows = block_rows or max(1, min(16, TILE_ELEMENTS // d_pad))
        blocks = -(-n // block_rows)
        per_program = -(-blocks // min(blocks, max_programs))
        num_warps = num_warps or min(8, max(1, block_rows * d_pad // 512))
        return cls(n, d, d_pad, float(eps), block_rows, blocks, -(-blocks // per_program), per_program,
                   num_warps, interpret)


def _tile(cfg: NormConfig, block):
    """Row indices `[block_rows]` of tile `block`, their mask, and the `[block_rows, d_pad]` mask."""
    rows = block * cfg.block_rows + jnp.arange(cfg.block_rows)
    row_ok = rows < cfg.n
    return rows, row_ok, row_ok[:, None] & (jnp.arange(cfg.d_pad) < cfg.d)[None, :]


def _load(ref, rows, cols, mask):
    """A `[rows, cols]` tile of a 2-D ref in float32, zeros where masked."""
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(jnp.float32)


def _load_scale(cfg: NormConfig, w_ref):
    """Column indices `[d_pad]`, their mask, and scale `[d_pad]` float32 (zero-padded)."""
    cols = jnp.arange(cfg.d_pad)
    col_ok = cols < cfg.d
    return cols, col_ok, plgpu.load(w_ref.at[cols], mask=col_ok, other=0.0).astype(jnp.float32)


def _forward_kernel(x_ref, w_ref, y_ref, rstd_ref, *, cfg: NormConfig):
    cols, _, w = _load_scale(cfg, w_ref)
    rows, row_ok, mask = _tile(cfg, pl.program_id(0))
    x = _load(x_ref, rows, cols, mask)
    rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / cfg.d + cfg.eps)
    y = x * rstd[:, None] * w[None, :]
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)
    plgpu.store(rstd_ref.at[rows], rstd, mask=row_ok)


def _backward_kernel(x_ref, w_ref, rstd_ref, g_ref, dx_ref, dw_ref, *, cfg: NormConfig):
    program = pl.program_id(0)
    cols, col_ok, w = _load_scale(cfg, w_ref)

    def body(i, dw):
        rows, row_ok, mask = _tile(cfg, program * cfg.per_program + i)
        x, g = _load(x_ref, rows, cols, mask), _load(g_ref, rows, cols, mask)
        rstd = plgpu.load(rstd_ref.at[rows], mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]  # Zero on masked rows and columns.
        gw = g * w[None, :]
        c = jnp.sum(gw * xhat, axis=1) / cfg.d
        dx = rstd[:, None] * (gw - xhat * c[:, None])
        plgpu.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dx_ref.dtype), mask=mask)
        return dw + jnp.sum(g * xhat, axis=0)

    dw = lax.fori_loop(0, cfg.per_program, body, jnp.zeros((cfg.d_pad,), jnp.float32))
    plgpu.store(dw_ref.at[program * cfg.d + cols], dw, mask=col_ok)  # Row `program` of [programs, d].


def _call(kernel, cfg: NormConfig, grid: int, out_shape, name: str):
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid=(grid,),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=cfg.interpret,
        name=name,
    )


def _pallas_forward(cfg: NormConfig, x2, scale):
    """y `[n, d]` in x's dtype and rstd `[n]` float32."""
    out_shape = [jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((cfg.n,), jnp.float32)]
    return _call(_forward_kernel, cfg, cfg.blocks, out_shape, "axcore_rms_norm_forward")(x2, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pallas_rms_norm(cfg: NormConfig, x2, scale):
    return _pallas_forward(cfg, x2, scale)[0]


def _pallas_fwd(cfg: NormConfig, x2, scale):
    y, rstd = _pallas_forward(cfg, x2, scale)
    return y, (x2, rstd, scale)


def _pallas_bwd(cfg: NormConfig, residuals, g):
    x2, rstd, scale = residuals
    out_shape = [jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((cfg.programs * cfg.d,), jnp.float32)]
    call = _call(_backward_kernel, cfg, cfg.programs, out_shape, "axcore_rms_norm_backward")
    dx, dw_partial = call(x2, scale, rstd, g.astype(x2.dtype))
    return dx, jnp.sum(dw_partial.reshape(cfg.programs, cfg.d), axis=0).astype(scale.dtype)


_pallas_rms_norm.defvjp(_pallas_fwd, _pallas_bwd)


def rms_norm_pallas(
    x,
    scale,
    eps: float,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
    max_programs: int = MAX_PROGRAMS,
    interpret: bool = False,
):
    """RMSNorm of x `[..., d]` with scale `[d]` by the Pallas kernels (module docstring); y in x's dtype."""
    d = x.shape[-1]
    n = math.prod(x.shape[:-1])
    cfg = NormConfig.of(n, d, eps, block_rows=block_rows, num_warps=num_warps, max_programs=max_programs,
                        interpret=interpret)
    return _pallas_rms_norm(cfg, x.reshape(n, d), scale).reshape(x.shape)


class PallasRMSNorm:
    """`rms_norm` by Pallas/Triton kernels, forward and backward (module docstring).

    Args:
        interpret: run the kernels in Pallas interpret mode (any platform; for tests).
        block_rows: rows per program, a power of two (None: TILE_ELEMENTS per tile, at most 16 rows).
        num_warps: Triton warps per program (None: one per 512 tile elements, 1 to 8).
        max_programs: most programs of the backward kernel (each loops over its row blocks).
        priority: selection priority (the `gpu` plugin registers it below the reference).
    """

    name = "pallas"
    priority = 60

    def __init__(
        self,
        *,
        interpret: bool = False,
        block_rows: int | None = None,
        num_warps: int | None = None,
        max_programs: int = MAX_PROGRAMS,
        priority: int = 60,
    ):
        if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
            raise ValueError(f"block_rows {block_rows}: must be a power of two")
        if max_programs < 1:
            raise ValueError(f"max_programs {max_programs}: must be at least 1")
        self.interpret = interpret
        self.priority = priority
        self.options = dict(block_rows=block_rows, num_warps=num_warps, max_programs=max_programs, interpret=interpret)

    def is_supported(self, problem: RMSNormProblem) -> Support:
        if problem.platform != "gpu" and not self.interpret:
            return Support(
                False, f"platform is '{problem.platform}'; Pallas Triton kernels run on GPUs (or interpret=True)"
            )
        if problem.dtype not in PALLAS_DTYPES:
            return Support(False, f"dtype {problem.dtype.name}: the Pallas kernel takes bfloat16, float16 or float32")
        if not 1 <= problem.dim <= MAX_DIM:
            return Support(False, f"dim {problem.dim}: the Pallas kernel takes 1 to {MAX_DIM} (a row in registers)")
        if problem.rows < 1:
            return Support(False, "x has no rows")
        mesh = problem.mesh
        if mesh is not None and math.prod(mesh.shape.values()) > 1:
            return Support(False, "a multi-device mesh: the Pallas kernel has no shard_map wrapper yet")
        return unknown_extras(problem)

    def __call__(self, problem: RMSNormProblem, x: jax.Array, scale: jax.Array) -> jax.Array:
        return rms_norm_pallas(x, scale, problem.eps, **self.options)


__all__ = ["FusedVjpRMSNorm", "PallasRMSNorm", "rms_norm_fused_vjp", "rms_norm_pallas"]
