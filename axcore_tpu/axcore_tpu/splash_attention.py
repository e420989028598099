"""Splash attention (JAX's Pallas TPU kernel) for the `attention` op.

Kernels of the `attention` op with the `tpu` plugin, tried in this order (highest
priority first):

    100  splash      this module: `jax.experimental.pallas.ops.tpu.splash_attention`
     90  pallas_tpu  flash_attention.py: JAX's older Pallas TPU flash attention (causal
                     with q_len == kv_len, segment ids; no window or soft-cap)
      0  xla         axcore's reference kernel, every capability (the fallback)

Mapping from an `AttentionProblem` (see `axcore.kernels.attention`) to splash attention:

    layout        q `[b, t, n, h]` -> `[b, n, t, h]`, k and v `[b, s, kv, h]` -> `[b, kv, s, h]`;
                  the kernel (`make_splash_mha`, whose MHA form takes n a multiple of kv:
                  GQA/MQA natively, k and v never repeated) is vmapped over the batch
    scale         splash has none: q is multiplied by `scale` first (in q's dtype; exact for
                  a power-of-two scale, else one extra rounding of q)
    causal        `CausalMask(offset=kv_len - q_len)`: key j visible iff j <= i + offset,
                  exactly axcore's end-aligned causal mask
    window w      `LocalMask(window_size=(w - 1, 0 if causal else None), offset)`: key j
                  visible iff i + offset - (w - 1) <= j, i.e. axcore's i + offset - j < w;
                  a window of kv_len or more hides nothing and is dropped
    soft-cap c    `attn_logits_soft_cap=c`: c * tanh(logits / c) on the scaled logits
    segment ids   `SegmentIds(q, kv)` per example
    kv_mask       folded into segment ids: q ids 2 * seg, kv ids 2 * seg + (1 - keep), so a
                  padding key matches no query (exact for segment ids below 2**30)
    head_dim      zero-padded to a multiple of 128 (the TPU lane width) when it is not one:
                  zero columns add nothing to q.k, and the padded output columns are
                  dropped; it costs 128 / head_dim more MXU work for, e.g., head_dim 64

Declined, with the reason (`is_supported`): another platform than tpu (unless
interpret=True), dtypes other than bfloat16 and float32, q_len or kv_len not a
multiple of 128 (splash's blocks are multiples of the lane width and must divide the
lengths), causal attention with q_len > kv_len (its first rows see no key: splash's
softmax is undefined there), a window < 1, num_heads not a multiple of num_kv_heads,
attention dropout, ALiBi slopes, a bias function or a dense bias (splash has no bias
input), unknown extras, and shardings `axcore_tpu.sharding.mesh_layout` declines
(anything but batch and heads).

Block sizes: the largest multiple of 128 up to `block_q` (default 512, MaxText's
default) that divides q_len; the same for keys (`block_kv`), and the same blocks for the
backward kernels (untuned: no TPU was available to time them). Under a batch/head-sharded mesh the call runs inside `jax.shard_map`, each
device attending its own rows and heads (`head_shards=1` per device).

Rows whose keys are all masked (a query whose segment has no key, or whose visible
keys are all padding) are not guaranteed to match the reference (which averages every
key for them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from axcore.kernels import SUPPORTED, AttentionProblem, Support
from axcore.kernels.fused_attention import FusedAttentionKernel

from axcore_tpu.sharding import mesh_layout

# Dtypes of q, k, v the TPU kernels take.
TPU_ATTENTION_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
# The TPU vector lane width: splash's blocks (and so the sequence lengths) are multiples of it,
# and head_dim is padded to one.
LANES = 128
DEFAULT_BLOCK = 512


def effective_window(problem: AttentionProblem) -> int | None:
    """The problem's sliding window, or None when it excludes no key (window >= kv_len)."""
    window = problem.sliding_window
    if window is None or window >= problem.kv_len:
        return None
    return window


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a multiple of the lane width."""
    return -(-head_dim // LANES) * LANES


def pad_head_dim(x: jax.Array) -> jax.Array:
    """x `[..., head_dim]` zero-padded to `padded_head_dim` (x itself when already a multiple)."""
    head_dim = x.shape[-1]
    padded = padded_head_dim(head_dim)
    if padded == head_dim:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - head_dim)])


def segment_ids_with_mask(batch: int, q_len: int, kv_len: int, q_segment_ids=None, kv_segment_ids=None, kv_mask=None):
    """`(q_ids, kv_ids)` int32 `[b, t]`, `[b, s]` whose equality is axcore's segment and key-mask test, or None.

    With a key mask, q ids are `2 * seg` and kv ids `2 * seg + (1 - keep)` (seg 0 without
    segment ids): a kept key matches exactly its segment's queries, a padding key none.
    """
    if q_segment_ids is None and kv_mask is None:
        return None
    if q_segment_ids is None:
        q_ids = jnp.zeros((batch, q_len), jnp.int32)
        kv_ids = jnp.zeros((batch, kv_len), jnp.int32)
    else:
        q_ids, kv_ids = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    if kv_mask is None:
        return q_ids, kv_ids
    dropped = 1 - kv_mask.astype(jnp.int32)
    return 2 * q_ids, 2 * kv_ids + dropped


def check_common(problem: AttentionProblem, *, interpret: bool, what: str) -> Support:
    """The checks both TPU kernels share (platform, dtype, lengths, heads, unsupported biases)."""
    if problem.platform != "tpu" and not interpret:
        return Support(False, f"platform is '{problem.platform}'; {what} runs on TPUs (or interpret=True)")
    dtype = np.dtype(problem.dtype)
    if dtype not in TPU_ATTENTION_DTYPES:
        return Support(False, f"dtype {dtype.name}: {what} takes bfloat16 or float32")
    if problem.q_len < 1 or problem.kv_len < 1 or problem.q_len % LANES or problem.kv_len % LANES:
        return Support(
            False,
            f"q_len {problem.q_len} and kv_len {problem.kv_len} must be positive multiples of {LANES} "
            f"(the TPU lane width its blocks are made of)",
        )
    if problem.head_dim < 1:
        return Support(False, f"head_dim {problem.head_dim} < 1")
    if problem.num_heads % problem.num_kv_heads:
        return Support(False, f"num_heads {problem.num_heads} is not a multiple of num_kv_heads {problem.num_kv_heads}")
    declined = [
        (problem.dropout_rate > 0.0, "attention dropout"),
        (problem.bias_slopes is not None, "ALiBi slopes (no bias input)"),
        (problem.bias_fn is not None, "a position-bias function (no bias input)"),
        (problem.has_bias, "a dense bias (not mapped by this kernel)"),
    ]
    for present, name in declined:
        if present:
            return Support(False, f"does not implement {name}")
    if problem.sliding_window is not None and problem.sliding_window < 1:
        return Support(False, f"sliding_window {problem.sliding_window} < 1")
    return SUPPORTED


def _fit_block(block: int, length: int) -> int:
    """The largest multiple of LANES up to `block` that divides `length` (a multiple of LANES)."""
    return next(b for b in range(block, 0, -LANES) if length % b == 0)


def splash_mask(q_len: int, kv_len: int, *, causal: bool, window: int | None) -> splash.Mask:
    """The 2-D splash mask of axcore's causal/window semantics (module docstring)."""
    offset = kv_len - q_len
    shape = (q_len, kv_len)
    if window is not None:
        return splash.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=offset)
    if causal:
        return splash.CausalMask(shape, offset=offset)
    return splash.FullMask(shape)


@functools.lru_cache(maxsize=64)
def _kernel(heads, q_len, kv_len, causal, window, softcap, block_q, block_kv, interpret):
    """A splash MHA kernel for one example's `[heads, t, h]` queries (cached: its masks are built in NumPy)."""
    bq, bkv = _fit_block(block_q, q_len), _fit_block(block_kv, kv_len)
    sizes = splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv,
        block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
        block_q_dq=bq, block_kv_dq=bkv,
    )
    mask = splash.MultiHeadMask([splash_mask(q_len, kv_len, causal=causal, window=window)] * heads)
    # Its mask tables become concrete arrays (not tracers of the trace that first asked), so
    # the cached kernel serves every later trace.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret
        )


class TpuAttentionKernel(FusedAttentionKernel):
    """The tail both TPU kernels share: this package's mesh layout, and the key mask folded into segment ids."""

    def mesh_layout(self, problem: AttentionProblem):
        return mesh_layout(problem)

    def rows(self, problem: AttentionProblem, q, k, *, kv_mask, q_segment_ids, kv_segment_ids):
        """`q_segment_ids`, `kv_segment_ids` of `segment_ids_with_mask` (none without segment ids or a mask)."""
        ids = segment_ids_with_mask(q.shape[0], q.shape[1], k.shape[1], q_segment_ids, kv_segment_ids, kv_mask)
        return {} if ids is None else {"q_segment_ids": ids[0], "kv_segment_ids": ids[1]}


class SplashAttention(TpuAttentionKernel):
    """Splash attention from JAX's Pallas TPU ops (module docstring: mapping, declines, sharding).

    Args:
        interpret: run the Pallas kernels in interpret mode (any platform; for tests).
        block_q, block_kv: the largest query/key block (multiples of 128; the blocks used
            are the largest multiples of 128 up to these that divide the lengths).
        priority: selection priority (100: before the pallas_tpu fallback and the reference).
    """

    name = "splash"
    priority = 100

    def __init__(self, *, interpret: bool = False, block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK,
                 priority: int = 100):
        for what, block in (("block_q", block_q), ("block_kv", block_kv)):
            if block < LANES or block % LANES:
                raise ValueError(f"{what} {block}: splash blocks must be positive multiples of {LANES}")
        self.interpret = interpret
        self.block_q, self.block_kv = block_q, block_kv
        self.priority = priority

    def check(self, problem: AttentionProblem) -> Support:
        support = check_common(problem, interpret=self.interpret, what="splash attention")
        if not support:
            return support
        if problem.causal and problem.q_len > problem.kv_len:
            return Support(
                False,
                f"causal with q_len {problem.q_len} > kv_len {problem.kv_len}: the first rows see no key, "
                f"where splash's softmax is undefined",
            )
        return SUPPORTED

    def attend(self, problem: AttentionProblem, q, k, v, q_segment_ids=None, kv_segment_ids=None):
        head_dim = q.shape[-1]
        kernel = _kernel(
            q.shape[2], q.shape[1], k.shape[1], bool(problem.causal), effective_window(problem),
            None if problem.softcap is None else float(problem.softcap),
            self.block_q, self.block_kv, self.interpret,
        )
        # [b, t, n, h] -> [b, n, t, h]; the scale goes into q (splash has none).
        qs = pad_head_dim(jnp.swapaxes((q * jnp.asarray(problem.scale, q.dtype)).astype(q.dtype), 1, 2))
        ks = pad_head_dim(jnp.swapaxes(k, 1, 2))
        vs = pad_head_dim(jnp.swapaxes(v, 1, 2))
        if q_segment_ids is not None:
            segments = splash.SegmentIds(q=q_segment_ids, kv=kv_segment_ids)
            out = jax.vmap(kernel, in_axes=(0, 0, 0, splash.SegmentIds(0, 0)))(qs, ks, vs, segments)
        else:
            out = jax.vmap(kernel)(qs, ks, vs)
        return jnp.swapaxes(out[..., :head_dim], 1, 2).astype(q.dtype)


__all__ = [
    "LANES",
    "SplashAttention",
    "TpuAttentionKernel",
    "check_common",
    "effective_window",
    "pad_head_dim",
    "segment_ids_with_mask",
    "splash_mask",
]
