"""What the Pallas (Triton) flash attention's forward and backward kernels share.

`FlashConfig` (the static description of one padded call), the limits and the mask
value, and the tile helpers both kernel modules use: the logits and mask of a
`[block_q, block_k]` tile, the causal/window block ranges, the split of a kernel's
refs, and the optional inputs in their order. `pallas_attention` (the forward, the
custom VJP and the kernel class) and `pallas_attention_backward` import this module,
not each other's helpers (the semantics are in `pallas_attention`'s docstring).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu

# Dtypes of q, k, v the kernel takes (Triton dots in bf16/f16 with f32 accumulation, or f32).
PALLAS_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
# Largest head_dim: [block, head_dim] tiles of q, k, v and the float32 accumulator must fit on chip.
MAX_HEAD_DIM = 256
# Smallest tile edge Triton's dot takes.
MIN_BLOCK = 16
# Logit of a masked key: finite, so a row max over masked keys stays finite (no inf - inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static description of one (padded) call, shared by the forward and backward kernels."""

    scale: float
    causal: bool
    window: int | None
    softcap: float | None
    q_len: int  # True lengths; the arrays are padded to q_pad, kv_pad.
    kv_len: int
    q_pad: int
    kv_pad: int
    group: int  # Query heads per kv head.
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    has_segments: bool
    # With segment ids: bound the block loops by the blocks each tile's segments reach (pallas_segment_ranges).
    segment_ranges: bool
    has_kv_mask: bool
    float32: bool
    interpret: bool
    num_warps: int
    num_stages: int

    def compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def dot(cfg: FlashConfig, a, b, *, trans_a=False, trans_b=False):
    """`a @ b` in float32 (IEEE for float32 inputs, where Triton would default to TF32)."""
    precision = lax.Precision.HIGHEST if cfg.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def logits_and_mask(cfg: FlashConfig, q, k, rows, cols, q_seg=None, kv_seg=None, kv_keep=None):
    """Soft-capped logits `[rows, cols]` float32 (unmasked) and the visibility mask (None: all visible)."""
    s = dot(cfg, q, k, trans_b=True) * cfg.scale
    if cfg.softcap is not None:
        s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    offset = cfg.kv_len - cfg.q_len
    parts = []
    if cfg.causal:
        parts.append(cols[None, :] <= rows[:, None] + offset)
    if cfg.window is not None:
        parts.append(rows[:, None] + offset - cols[None, :] < cfg.window)
    if cfg.kv_pad != cfg.kv_len:
        parts.append(jnp.broadcast_to(cols[None, :] < cfg.kv_len, s.shape))
    if q_seg is not None:
        parts.append(q_seg[:, None] == kv_seg[None, :])
    if kv_keep is not None:
        parts.append(jnp.broadcast_to(kv_keep[None, :] != 0, s.shape))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return s, mask


def _cdiv(x, d: int):
    """Ceil division of a nonnegative traced int by a static int (lax.div truncates)."""
    return lax.div(x + (d - 1), d)


def key_block_range(cfg: FlashConfig, q_block, block_q: int, block_k: int):
    """`[lo, hi)` key blocks holding any key visible to query block `q_block`."""
    offset = cfg.kv_len - cfg.q_len
    lo, hi = 0, _cdiv(jnp.int32(cfg.kv_len), block_k)  # Blocks of padding keys only: skipped.
    if cfg.causal:  # Last visible key of the block's last row: (q_block + 1) * block_q - 1 + offset.
        hi = jnp.minimum(hi, _cdiv(jnp.maximum((q_block + 1) * block_q + offset, 0), block_k))
    if cfg.window is not None:  # First visible key of its first row: q_block * block_q + offset - window + 1.
        lo = lax.div(jnp.maximum(q_block * block_q + offset - cfg.window + 1, 0), block_k)
    return lo, hi


def query_block_range(cfg: FlashConfig, k_block, block_q: int, block_k: int):
    """`[lo, hi)` query blocks holding any query that sees a key of key block `k_block`."""
    offset = cfg.kv_len - cfg.q_len
    lo, hi = 0, _cdiv(jnp.int32(cfg.q_len), block_q)  # Blocks of padding rows only: skipped.
    if cfg.causal:  # First row seeing the block's first key: k_block * block_k - offset.
        lo = lax.div(jnp.maximum(k_block * block_k - offset, 0), block_q)
    if cfg.window is not None:  # Rows seeing its last key: r < (k_block + 1) * block_k - 1 - offset + window.
        hi = jnp.minimum(hi, _cdiv(jnp.maximum((k_block + 1) * block_k - 1 - offset + cfg.window, 0), block_q))
    return lo, hi


def split_refs(cfg: FlashConfig, refs):
    """(q, k, v, q_seg, kv_seg, kv_keep) refs, the segments' block range ref, then the rest; absent ones None."""
    q_ref, k_ref, v_ref, *rest = refs
    q_seg_ref = kv_seg_ref = keep_ref = range_ref = None
    if cfg.has_segments:
        q_seg_ref, kv_seg_ref, *rest = rest
    if cfg.has_kv_mask:
        keep_ref, *rest = rest
    if cfg.has_segments and cfg.segment_ranges:
        range_ref, *rest = rest
    return (q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, keep_ref), range_ref, rest


def within_segments(range_ref, lo, hi):
    """`[lo, hi)` narrowed to the blocks the segments leave visible (`pallas_segment_ranges`), if any."""
    if range_ref is None:
        return lo, hi
    return jnp.maximum(lo, range_ref[0]), jnp.minimum(hi, range_ref[1])


def out_struct(like, shape, dtype) -> jax.ShapeDtypeStruct:
    """An output of a pallas_call varying over the same mesh axes as `like` (inside jax.shard_map)."""
    mat = getattr(jax.typeof(like), "mat", None)  # The manual axes `like` varies over.
    return jax.ShapeDtypeStruct(shape, dtype, **({} if mat is None else {"manual_axis_type": mat}))


def optional_inputs(cfg: FlashConfig, q_seg, kv_seg, kv_keep, ranges=None):
    """The optional kernel inputs in `split_refs` order (segment ids, key mask, the segments' block ranges)."""
    return ((q_seg, kv_seg) if cfg.has_segments else ()) + ((kv_keep,) if cfg.has_kv_mask else ()) + (
        (ranges,) if ranges is not None else ()
    )
