"""Pallas (Triton) decode attention over the engine's paged KV cache: the `paged_attention` op, one new token per row.

Semantics are the op's (`axcore.kernels.paged_attention`): the cache `[num_blocks,
block_size, kv_heads, head_dim]` per layer, each row's block table, token (b, 0) at
`positions[b, 0]` attends to its sequence's slots `j <= positions[b, 0]` (and
`positions[b, 0] - j < sliding_window`), logits `scale * q.k` soft-capped, GQA/MQA.

Flash-decoding: the grid is (batch, kv_heads, splits). Program (b, k, s) reads, for kv
head k, the blocks of row b's table that split s covers, up to the block holding the
new token (and from the first block the window reaches), one `[block_size, head_dim]`
tile at a time straight from the cache (no gather), and multiplies it with the
`[group, head_dim]` queries of that kv head's query heads (padded to 16 rows, Triton's
smallest dot) with an online softmax in float32. The splits' partial outputs, maxima
and sums are combined after the call, so a batch-1 decode still spreads one long
sequence over many programs.

Declines, each with its reason (the XLA reference runs them): more than one new token
per row (prefill chunks), ALiBi slopes or a `bias_fn`, head_dim not a power of two in
16..256, block_size not a power of two >= 16, dtypes other than bfloat16, float16 and
float32, a platform other than `gpu` unless `interpret=True` (tests on CPU).

Not yet timed on a GPU: the gpu plugin registers it below the XLA reference (module
`axcore_gpu.plugin`), so it runs only when registered with a higher priority.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from axcore.kernels import SUPPORTED, PagedAttentionProblem, Support

from axcore_gpu.pallas_common import MASK_VALUE, MIN_BLOCK, PALLAS_DTYPES

# Largest head_dim: the [16, head_dim] queries and float32 accumulator and a [block_size, head_dim] tile on chip.
MAX_HEAD_DIM = 256
# Programs the automatic split count aims for (an H100/H200 has 132 SMs): batch x kv_heads x splits.
TARGET_PROGRAMS = 256


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static description of one call."""

    scale: float
    softcap: float | None
    window: int | None
    block_size: int
    blocks_per_split: int
    float32: bool


def _decode_kernel(q_ref, key_ref, value_ref, tables_ref, pos_ref, o_ref, m_ref, l_ref, *, cfg: DecodeConfig):
    """One (row, kv head, split): q_ref `[group_pad, h]`, key_ref/value_ref the whole cache `[nb, bs, kv, h]`,
    tables_ref `[max_blocks]`, pos_ref `[1]`; writes o_ref `[group_pad, h]` (unnormalised, float32), m_ref and
    l_ref `[group_pad]` (the running maximum and sum of this split)."""
    kv, split = pl.program_id(1), pl.program_id(2)
    pos = pos_ref[0]
    bs = cfg.block_size
    first = 0 if cfg.window is None else jnp.maximum(pos - cfg.window + 1, 0) // bs
    lo = jnp.maximum(first, split * cfg.blocks_per_split)
    hi = jnp.minimum(pos // bs + 1, (split + 1) * cfg.blocks_per_split)
    q = q_ref[...]
    precision = lax.Precision.HIGHEST if cfg.float32 else None

    def body(i, carry):
        acc, m, l = carry
        block = tables_ref[i]
        k = key_ref[block, :, kv, :]  # [bs, h]
        v = value_ref[block, :, kv, :]
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * cfg.scale  # [group_pad, bs] float32
        if cfg.softcap is not None:
            s = cfg.softcap * jnp.tanh(s / cfg.softcap)
        slots = i * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1)
        visible = slots <= pos
        if cfg.window is not None:
            visible = visible & (pos - slots < cfg.window)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l * correction + p.sum(axis=1)

    rows, head_dim = q.shape
    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _split_count(batch: int, kv_heads: int, max_blocks: int, splits: int | None) -> int:
    if splits is not None:
        return max(1, min(splits, max_blocks))
    return max(1, min(max_blocks, TARGET_PROGRAMS // max(1, batch * kv_heads)))


@functools.partial(jax.jit, static_argnames=("cfg", "splits", "interpret", "num_warps", "num_stages"))
def _paged_decode(q, key, value, block_tables, positions, *, cfg, splits, interpret, num_warps, num_stages):
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    group_pad = max(MIN_BLOCK, 1 << (group - 1).bit_length())
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    max_blocks = block_tables.shape[1]
    per_split = -(-max_blocks // splits)
    cfg = dataclasses.replace(cfg, blocks_per_split=per_split)
    tables = jnp.pad(block_tables, ((0, 0), (0, per_split * splits - max_blocks)))
    out_shape = [
        jax.ShapeDtypeStruct((batch, num_kv_heads, splits, group_pad, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, splits, group_pad), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, splits, group_pad), jnp.float32),
    ]
    o, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, cfg=cfg),
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, None, group_pad, head_dim), lambda b, k, s: (b, k, 0, 0)),
            pl.BlockSpec(key.shape, lambda b, k, s: (0, 0, 0, 0)),
            pl.BlockSpec(value.shape, lambda b, k, s: (0, 0, 0, 0)),
            pl.BlockSpec((None, tables.shape[1]), lambda b, k, s: (b, 0)),
            pl.BlockSpec((None, 1), lambda b, k, s: (b, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group_pad, head_dim), lambda b, k, s: (b, k, s, 0, 0)),
            pl.BlockSpec((None, None, None, group_pad), lambda b, k, s: (b, k, s, 0)),
            pl.BlockSpec((None, None, None, group_pad), lambda b, k, s: (b, k, s, 0)),
        ],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="axcore_paged_decode",
    )(qg, key, value, tables, positions[:, :1].astype(jnp.int32))
    # Combine the splits: each holds sum_j exp(s_j - m) v_j and sum_j exp(s_j - m) over its blocks.
    m_all = m.max(axis=2, keepdims=True)
    weight = jnp.exp(m - m_all)  # An empty split (m = MASK_VALUE) weighs 0.
    total = (l * weight).sum(axis=2)
    out = (o * weight[..., None]).sum(axis=2) / total[..., None]
    return out[:, :, :group].reshape(batch, 1, num_heads, head_dim).astype(q.dtype)


class PallasPagedDecode:
    """Pallas/Triton decode attention over the paged cache (module docstring: semantics, declines).

    Args:
        interpret: run the kernel in Pallas interpret mode (any platform; for tests).
        splits: programs per (row, kv head) the table is split over (None: enough for
            about `TARGET_PROGRAMS` programs in all).
        num_warps, num_stages: Triton launch settings.
        priority: selection priority (module docstring: below the reference until timed).
    """

    name = "pallas_decode"

    def __init__(self, *, interpret: bool = False, splits: int | None = None, num_warps: int = 4,
                 num_stages: int = 2, priority: int = -5):
        if splits is not None and splits < 1:
            raise ValueError(f"splits {splits}: give a positive count or None")
        self.interpret, self.splits, self.priority = interpret, splits, priority
        self.num_warps, self.num_stages = num_warps, num_stages

    def is_supported(self, problem: PagedAttentionProblem) -> Support:
        if problem.platform != "gpu" and not self.interpret:
            return Support(False, f"platform is '{problem.platform}'; Pallas Triton runs on GPUs (or interpret=True)")
        if problem.q_len != 1:
            return Support(False, f"{problem.q_len} new tokens per row: this kernel decodes one (prefill: the reference)")
        if np.dtype(problem.dtype) not in PALLAS_DTYPES:
            return Support(False, f"dtype {np.dtype(problem.dtype).name}: takes bfloat16, float16 or float32")
        if not (_power_of_two(problem.head_dim) and MIN_BLOCK <= problem.head_dim <= MAX_HEAD_DIM):
            return Support(False, f"head_dim {problem.head_dim}: takes a power of two from {MIN_BLOCK} to {MAX_HEAD_DIM}")
        if not (_power_of_two(problem.block_size) and problem.block_size >= MIN_BLOCK):
            return Support(False, f"block_size {problem.block_size}: takes a power of two >= {MIN_BLOCK}")
        if problem.num_heads % problem.num_kv_heads:
            return Support(False, "num_heads must be a multiple of num_kv_heads")
        if problem.bias_slopes is not None or problem.bias_fn is not None:
            return Support(False, "position biases (ALiBi slopes, bias_fn) are not supported")
        return SUPPORTED

    def __call__(self, problem: PagedAttentionProblem, q, key, value, block_tables, positions, num_new):
        """q `[batch, 1, heads, head_dim]` -> `[batch, 1, heads, head_dim]` in q's dtype (the op's contract)."""
        del num_new  # A padding row attends at its (ignored) position: finite values nobody reads.
        cfg = DecodeConfig(
            scale=float(problem.scale), softcap=problem.softcap, window=problem.sliding_window,
            block_size=problem.block_size, blocks_per_split=0, float32=np.dtype(problem.dtype) == np.float32,
        )
        splits = _split_count(problem.batch, problem.num_kv_heads, problem.max_blocks, self.splits)
        return _paged_decode(q, key, value, block_tables, positions, cfg=cfg, splits=splits,
                             interpret=self.interpret, num_warps=self.num_warps, num_stages=self.num_stages)
