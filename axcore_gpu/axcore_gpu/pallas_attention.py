"""Pallas (Triton) flash attention for the `attention` op on GPUs.

Computes axcore's attention (see `axcore.kernels.attention`): logits `scale * q.k`,
the soft-cap `softcap * tanh(logits / softcap)`, the masks (end-aligned causal,
sliding window, segment ids, kv_mask), softmax in float32 and the probabilities
(in v's dtype) times v; the output has q's dtype. FlashAttention-2: each program
of the forward kernel owns `block_q` query rows of one head and runs an online
softmax over `block_k`-key blocks, keeping float32 accumulators and saving the
row logsumexp; the backward (a `jax.custom_vjp`, `pallas_attention_backward`)
recomputes the probabilities from it: one kernel for dq (which also reduces
`delta = rowsum(dO * O)`), one for dk and dv. Grouped-query attention reads kv head
`n // group` through the BlockSpec index maps (k and v are never repeated); the
dk/dv kernel owns one kv head and loops over its group of query heads. Key blocks
the causal mask or the window hide are skipped (loop bounds), and with segment ids so
are the blocks no document of a tile reaches (`pallas_segment_ranges`).

Kernels of the `attention` op with the gpu plugin, tried in priority order:

    100  cudnn   cuDNN flash attention (bfloat16/float16, no segment ids or soft-cap)
     90  pallas  this module: packed documents (segment ids), soft-cap, float32, causal
                 with q_len != kv_len, everything cuDNN declines
      0  xla     axcore's reference kernel, every capability (the fallback)

Supported / declined (`PallasAttention.is_supported`, each decline with its reason):

    platform       "gpu" (CUDA or ROCm Triton); any platform with interpret=True
    dtype          bfloat16, float16, float32 (float32 matmuls use IEEE precision,
                   not TF32); others declined
    head_dim       1..256, zero-padded internally to a power of two >= 16 (Triton's
                   dot needs power-of-two tiles of at least 16); over 256 declined
    lengths        any q_len, kv_len >= 1: padded internally to multiples of the
                   block sizes, padding keys masked, padding rows dropped
    GQA/MQA        num_heads a multiple of num_kv_heads, else declined
    masks          causal (end-aligned), sliding window >= 1, segment ids, kv_mask
    soft-cap       yes (its derivative in the backward)
    declined       attention dropout, ALiBi slopes, a bias function, a dense bias,
                   unknown extras, shardings `mesh_layout` declines (anything but
                   batch and heads)

Block sizes: powers of two >= 16 (checked by the constructor); each is clamped to
the sequence length rounded up to a power of two (at least 16). Defaults (None):
forward 128 query rows x 64 keys for bfloat16/float16 and 64 x 64 for float32,
backward 64 x 64; num_warps 4 for head_dim <= 64 else 8, num_stages 2 (the fastest
set `benchmarks/gpu_attention.py` timed on an H200, bfloat16, head_dim 128). Padding
(lengths off the block grid, head_dim not a power of two) copies q, k and v once. Under a multi-device mesh the call runs inside `jax.shard_map` over
the batch and head axes of the input specs, like `CudnnAttention`.

Rows whose keys are all masked (e.g. causal with q_len > kv_len, or a query whose
segment has no key) output 0 and get zero gradients; the reference averages every
key for them instead, so the two differ only on such rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from axcore.kernels import SUPPORTED, AttentionProblem, Support
from axcore.kernels.fused_attention import FusedAttentionKernel

from axcore_gpu.pallas_attention_backward import flash_backward
from axcore_gpu.pallas_common import (
    MASK_VALUE,
    MAX_HEAD_DIM,
    MIN_BLOCK,
    PALLAS_DTYPES,
    FlashConfig,
    dot,
    key_block_range,
    logits_and_mask,
    optional_inputs,
    out_struct,
    split_refs,
    within_segments,
)
from axcore_gpu.pallas_segment_ranges import visible_block_ranges


def _forward_kernel(*refs, cfg: FlashConfig):
    (q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, keep_ref), range_ref, (o_ref, lse_ref) = split_refs(cfg, refs)
    bq, bk = cfg.block_q, cfg.block_k
    q_block = pl.program_id(2)
    q = q_ref[...]
    rows = q_block * bq + jnp.arange(bq)
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def body(kb, carry):
        acc, m, l = carry
        start = pl.multiple_of(kb * bk, bk)
        keys = pl.ds(start, bk)
        k, v = k_ref[keys, :], v_ref[keys, :]
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
        kv_keep = None if keep_ref is None else keep_ref[keys]
        s, mask = logits_and_mask(cfg, q, k, rows, start + jnp.arange(bk), q_seg, kv_seg, kv_keep)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)  # A row whose visible keys are all masked so far adds nothing.
        l = correction * l + jnp.sum(p, axis=1)
        acc = correction[:, None] * acc + dot(cfg, p.astype(v.dtype), v)
        return acc, m_next, l

    lo, hi = within_segments(range_ref, *key_block_range(cfg, q_block, bq, bk))
    acc = jnp.zeros((bq, q_ref.shape[-1]), jnp.float32)
    m = jnp.full((bq,), -jnp.inf, jnp.float32)
    l = jnp.zeros((bq,), jnp.float32)
    acc, m, l = lax.fori_loop(lo, hi, body, (acc, m, l))
    empty = l == 0.0  # No visible key: output 0, and lse +inf so the backward's probabilities are 0.
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def flash_forward(cfg: FlashConfig, q, k, v, q_seg, kv_seg, kv_keep):
    """Output `[b, q_pad, n, h]` in q's dtype and logsumexp `[b, n, q_pad]` float32 of padded inputs."""
    batch, q_pad, heads, head_dim = q.shape
    bq, kv_pad, group = cfg.block_q, cfg.kv_pad, cfg.group
    in_specs = [
        pl.BlockSpec((None, bq, None, head_dim), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, kv_pad, None, head_dim), lambda b, n, i: (b, 0, n // group, 0)),
        pl.BlockSpec((None, kv_pad, None, head_dim), lambda b, n, i: (b, 0, n // group, 0)),
    ]
    if cfg.has_segments:
        in_specs += [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
                     pl.BlockSpec((None, kv_pad), lambda b, n, i: (b, 0))]
    if cfg.has_kv_mask:
        in_specs.append(pl.BlockSpec((None, kv_pad), lambda b, n, i: (b, 0)))
    ranges = None
    if cfg.has_segments and cfg.segment_ranges:  # Key blocks of each query block that hold a key of its rows' segments.
        ranges = visible_block_ranges(q_seg, kv_seg, bq, cfg.block_k)
        in_specs.append(pl.BlockSpec((None, None, 2), lambda b, n, i: (b, i, 0)))
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        grid=(batch, heads, q_pad // bq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, head_dim), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[out_struct(q, q.shape, q.dtype), out_struct(q, (batch, heads, q_pad), jnp.float32)],
        compiler_params=cfg.compiler_params(),
        interpret=cfg.interpret,
        name="axcore_flash_forward",
    )(q, k, v, *optional_inputs(cfg, q_seg, kv_seg, kv_keep, ranges))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash_attention_padded(cfg: FlashConfig, q, k, v, q_seg, kv_seg, kv_keep):
    """Attention of inputs already padded to the config's lengths and a power-of-two head_dim."""
    return flash_forward(cfg, q, k, v, q_seg, kv_seg, kv_keep)[0]


def _flash_fwd(cfg: FlashConfig, q, k, v, q_seg, kv_seg, kv_keep):
    out, lse = flash_forward(cfg, q, k, v, q_seg, kv_seg, kv_keep)
    return out, (q, k, v, q_seg, kv_seg, kv_keep, out, lse)


def _flash_bwd(cfg: FlashConfig, residuals, d_out):
    dq, dk, dv = flash_backward(cfg, *residuals, d_out)
    return dq, dk, dv, None, None, None  # Segment ids and the key mask get no cotangent.


flash_attention_padded.defvjp(_flash_fwd, _flash_bwd)


def _fit_block(block: int, length: int) -> int:
    """The block size clamped to the length rounded up to a power of two (at least MIN_BLOCK)."""
    return min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def flash_attention(
    q,
    k,
    v,
    *,
    scale: float,
    causal: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    kv_mask=None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_backward: int | None = None,
    block_k_backward: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    segment_ranges: bool = True,
    interpret: bool = False,
):
    """Flash attention of q `[b, t, n, h]`, k and v `[b, s, kv, h]` (semantics: module docstring)."""
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    sixteen_bit = np.dtype(q.dtype).itemsize == 2
    bq, bk = _fit_block(block_q or (128 if sixteen_bit else 64), q_len), _fit_block(block_k or 64, kv_len)
    bq_bwd, bk_bwd = _fit_block(block_q_backward or 64, q_len), _fit_block(block_k_backward or 64, kv_len)
    # Powers of two: the larger of a pair is a multiple of the smaller.
    q_pad = -(-q_len // max(bq, bq_bwd)) * max(bq, bq_bwd)
    kv_pad = -(-kv_len // max(bk, bk_bwd)) * max(bk, bk_bwd)
    head_pad = max(MIN_BLOCK, pl.next_power_of_2(head_dim))
    # A window of kv_len or more hides no key (i + kv_len - q_len - j <= kv_len - 1).
    window = sliding_window if sliding_window is not None and sliding_window < kv_len else None
    cfg = FlashConfig(
        scale=float(scale),
        causal=bool(causal),
        window=window,
        softcap=None if softcap is None else float(softcap),
        q_len=q_len,
        kv_len=kv_len,
        q_pad=q_pad,
        kv_pad=kv_pad,
        group=heads // kv_heads,
        block_q=bq,
        block_k=bk,
        block_q_bwd=bq_bwd,
        block_k_bwd=bk_bwd,
        has_segments=q_segment_ids is not None,
        segment_ranges=segment_ranges,
        has_kv_mask=kv_mask is not None,
        float32=np.dtype(q.dtype) == np.float32,
        interpret=interpret,
        num_warps=num_warps or (4 if head_pad <= 64 else 8),
        num_stages=num_stages,
    )
    q_p = _pad_axis(_pad_axis(q, 1, q_pad), 3, head_pad)
    k_p = _pad_axis(_pad_axis(k, 1, kv_pad), 3, head_pad)
    v_p = _pad_axis(_pad_axis(v, 1, kv_pad), 3, head_pad)
    q_seg = kv_seg = kv_keep = None
    if cfg.has_segments:  # Padding keys are masked by position, whatever their segment.
        q_seg = _pad_axis(q_segment_ids.astype(jnp.int32), 1, q_pad)
        kv_seg = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, kv_pad)
    if cfg.has_kv_mask:
        kv_keep = _pad_axis(kv_mask.astype(jnp.int32), 1, kv_pad)
    out = flash_attention_padded(cfg, q_p, k_p, v_p, q_seg, kv_seg, kv_keep)
    return out[:, :q_len, :, :head_dim]


def _is_block(block: int) -> bool:
    return block >= MIN_BLOCK and block & (block - 1) == 0


class PallasAttention(FusedAttentionKernel):
    """Pallas/Triton flash attention (module docstring: semantics, declines, block sizes).

    Args:
        interpret: run the kernels in Pallas interpret mode (any platform; for tests).
        block_q, block_k: query rows and keys per tile of the forward kernel (None: the
            measured defaults of the module docstring).
        block_q_backward, block_k_backward: tiles of the backward kernels (None: 64 x 64).
        num_warps: Triton warps per program (None: 4 for head_dim <= 64, else 8).
        num_stages: Triton software-pipelining stages.
        segment_ranges: with segment ids, skip the key (query) blocks no row of a tile's
            segments reaches (`pallas_segment_ranges`); False visits every block the causal
            mask and window leave (for comparison).
        priority: selection priority (90: after cuDNN, before the XLA reference).
    """

    name = "pallas"
    # Default priority (the class's; an instance may be given another).
    priority = 90

    def __init__(
        self,
        *,
        interpret: bool = False,
        block_q: int | None = None,
        block_k: int | None = None,
        block_q_backward: int | None = None,
        block_k_backward: int | None = None,
        num_warps: int | None = None,
        num_stages: int = 2,
        segment_ranges: bool = True,
        priority: int = 90,
    ):
        blocks = dict(block_q=block_q, block_k=block_k, block_q_backward=block_q_backward,
                      block_k_backward=block_k_backward)
        for what, block in blocks.items():
            if block is not None and not _is_block(block):
                raise ValueError(f"{what} {block}: block sizes must be powers of two >= {MIN_BLOCK}")
        self.interpret = interpret
        self.priority = priority
        self.options = dict(blocks, num_warps=num_warps, num_stages=num_stages, segment_ranges=segment_ranges,
                            interpret=interpret)

    def check(self, problem: AttentionProblem) -> Support:
        if problem.platform != "gpu" and not self.interpret:
            return Support(
                False, f"platform is '{problem.platform}'; Pallas Triton attention runs on GPUs (or interpret=True)"
            )
        dtype = np.dtype(problem.dtype)
        if dtype not in PALLAS_DTYPES:
            return Support(False, f"dtype {dtype.name}: the Pallas kernel takes bfloat16, float16 or float32")
        if not 1 <= problem.head_dim <= MAX_HEAD_DIM:
            return Support(False, f"head_dim {problem.head_dim}: the Pallas kernel takes 1 to {MAX_HEAD_DIM}")
        if problem.q_len < 1 or problem.kv_len < 1:
            return Support(False, f"empty sequence (q_len {problem.q_len}, kv_len {problem.kv_len})")
        if problem.num_heads % problem.num_kv_heads:
            return Support(
                False, f"num_heads {problem.num_heads} is not a multiple of num_kv_heads {problem.num_kv_heads}"
            )
        declined = [
            (problem.dropout_rate > 0.0, "attention dropout"),
            (problem.bias_slopes is not None, "ALiBi slopes"),
            (problem.bias_fn is not None, "a position-bias function"),
            (problem.has_bias, "a dense bias"),
        ]
        for present, what in declined:
            if present:
                return Support(False, f"does not implement {what}")
        if problem.sliding_window is not None and problem.sliding_window < 1:
            return Support(False, f"sliding_window {problem.sliding_window} < 1")
        return SUPPORTED

    def attend(self, problem: AttentionProblem, q, k, v, **rows):
        """`rows`: `q_segment_ids` and `kv_segment_ids`, `kv_mask`, those given."""
        return flash_attention(
            q, k, v, scale=problem.scale, causal=problem.causal, sliding_window=problem.sliding_window,
            softcap=problem.softcap, **rows, **self.options,
        )
