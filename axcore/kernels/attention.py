"""The `attention` op: problem description and the XLA reference kernel.

Layout: q `[batch, q_len, num_heads, head_dim]`, k and v
`[batch, kv_len, num_kv_heads, head_dim]`, output `[batch, q_len, num_heads, head_dim]`.
With grouped-query attention `num_heads = num_kv_heads * group`, query head `n`
uses key/value head `n // group` (the same as repeating each kv head `group` times).

A kernel is called as `kernel(problem, q, k, v, **inputs)`; the optional array
inputs, present exactly when the problem says so, are:

- `kv_mask` `[batch, kv_len]` bool, False for padding keys (`has_kv_mask`);
- `q_segment_ids` `[batch, q_len]`, `kv_segment_ids` `[batch, kv_len]` int: packed
  sequences, query i sees key j only within one segment (`has_segment_ids`);
- `q_positions` `[batch, q_len]`, `kv_positions` `[batch, kv_len]` int: positions
  for position biases (`bias_slopes` or `bias_fn`);
- `bias` `[batch|1, heads|1, q_len, kv_len]`: a dense additive bias (`has_bias`;
  the slow path, which flash-style kernels decline);
- `dropout_key`: PRNG key of attention-probability dropout (`dropout_rate > 0`).

Logits are `scale * q.k`, then `softcap * tanh(logits / softcap)` if `softcap`,
then the position bias (ALiBi slopes `-slope_h * |i - j|` on positions, or
`bias_fn(q_positions, kv_positions)`, or the dense bias), then the masks: causal
(query i sees key j only if j <= i + kv_len - q_len), sliding window (and only if
i + kv_len - q_len - j < window), segments and the key mask.

With `extras[ZIGZAG_EXTRA] = N` (`axcore.kernels.attention_context`: the sequence is
stored in zigzag order for N context shards; self-attention only) the causal and
sliding-window masks compare the tokens' original indices instead of stored ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels.dot import wide_result
from axcore.kernels.registry import Op, Problem, Support, current_platform, unknown_extras


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionProblem(Problem):
    """What a kernel needs to decide whether it can run an attention call."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Dtype of q, k and v (the compute dtype); softmax always runs in float32.
    dtype: np.dtype
    # Softmax scale applied to q.k.
    scale: float
    # Query i sees key j only if j <= i + (kv_len - q_len).
    causal: bool = False
    # Query i sees key j only if i + (kv_len - q_len) - j < sliding_window; None = unlimited.
    sliding_window: int | None = None
    # Segment ids are given (packed sequences attend within their segment).
    has_segment_ids: bool = False
    # Logit soft-cap `softcap * tanh(logits / softcap)`; None = none.
    softcap: float | None = None
    # Dropout rate on attention probabilities (training only; 0 = none).
    dropout_rate: float = 0.0
    # ALiBi-style slopes, one per query head: bias `-slope_h * |q_pos - k_pos|`; None = none.
    bias_slopes: tuple[float, ...] | None = None
    # bias_fn(q_positions, kv_positions) -> `[batch|1, heads|1, q_len, kv_len]`; None = none.
    bias_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    # A dense additive bias array is given.
    has_bias: bool = False
    # A key padding mask `[batch, kv_len]` is given.
    has_kv_mask: bool = False
    # Dotted path of the call site.
    site: str = ""

    @classmethod
    def of(cls, q, k, *, platform: str | None = None, **fields: Any) -> AttentionProblem:
        """The problem of arrays q `[b, t, n, h]`, k `[b, s, kv, h]`; `fields` are the flags above."""
        fields.setdefault("scale", 1.0 / float(np.sqrt(q.shape[3])))
        return cls(
            platform=platform or current_platform(),
            batch=q.shape[0],
            q_len=q.shape[1],
            kv_len=k.shape[1],
            num_heads=q.shape[2],
            num_kv_heads=k.shape[2],
            head_dim=q.shape[3],
            dtype=np.dtype(q.dtype),
            **fields,
        )


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
    """`[q_len, kv_len]` bool, True where query i may attend key j (end-aligned)."""
    offset = kv_len - q_len
    return jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + offset


def sliding_window_mask(q_len: int, kv_len: int, window: int) -> jax.Array:
    """`[q_len, kv_len]` bool, True where key j is fewer than `window` positions behind query i."""
    offset = kv_len - q_len
    return jnp.arange(q_len)[:, None] + offset - jnp.arange(kv_len)[None, :] < window


def position_bias(problem: AttentionProblem, q_positions, kv_positions) -> jax.Array | None:
    """The float32 bias `[batch|1, heads|1, q_len, kv_len]` of the problem's slopes or bias_fn, or None."""
    if problem.bias_slopes is not None:
        slopes = jnp.asarray(problem.bias_slopes, jnp.float32)
        distance = jnp.abs(q_positions[:, :, None] - kv_positions[:, None, :]).astype(jnp.float32)
        return -slopes[None, :, None, None] * distance[:, None, :, :]
    if problem.bias_fn is not None:
        return problem.bias_fn(q_positions, kv_positions).astype(jnp.float32)
    return None


# Problem extra: the sequence is stored in zigzag order for this many context shards (see the module docstring).
ZIGZAG_EXTRA = "context_zigzag"


def zigzag_permutation(length: int, shards: int) -> np.ndarray:
    """`perm` `[length]` int: stored position p holds original position `perm[p]`.

    The sequence is cut into `2 * shards` chunks; stored block i (what device i of the
    context axis holds) is chunk i followed by chunk `2 * shards - 1 - i`. One shard
    is the identity. `length` must be a multiple of `2 * shards`.
    """
    if shards == 1:
        return np.arange(length)
    if length % (2 * shards):
        raise ValueError(f"a sequence of {length} cannot be split in 2 * {shards} zigzag chunks")
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def attention_mask(problem: AttentionProblem, kv_mask=None, q_segment_ids=None, kv_segment_ids=None) -> jax.Array:
    """`[batch|1, 1, q_len, kv_len]` bool: which keys each query may attend."""
    t, s = problem.q_len, problem.kv_len
    allowed = jnp.ones((1, 1, t, s), bool)
    shards = problem.extras.get(ZIGZAG_EXTRA, 1)
    if shards > 1 and (problem.causal or problem.sliding_window is not None):
        order = jnp.asarray(zigzag_permutation(t, shards))  # Original index of each stored position.
        if problem.causal:
            allowed = allowed & (order[None, None, None, :] <= order[None, None, :, None])
        if problem.sliding_window is not None:
            allowed = allowed & (order[None, None, :, None] - order[None, None, None, :] < problem.sliding_window)
    else:
        if problem.causal:
            allowed = allowed & causal_mask(t, s)[None, None]
        if problem.sliding_window is not None:
            allowed = allowed & sliding_window_mask(t, s, problem.sliding_window)[None, None]
    if q_segment_ids is not None:
        allowed = allowed & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    if kv_mask is not None:
        allowed = allowed & kv_mask[:, None, None, :].astype(bool)
    return allowed


class XlaAttention:
    """Reference attention in plain jax.numpy, every capability of the problem.

    Logits and softmax are computed in float32; the output has q's dtype. Rows whose
    keys are all masked produce a uniform average (never NaN).
    """

    name = "xla"
    # Lowest: every specialized kernel that supports a problem should win over it.
    priority = 0

    def is_supported(self, problem: AttentionProblem) -> Support:
        if problem.num_heads % problem.num_kv_heads:
            return Support(False, "num_heads must be a multiple of num_kv_heads")
        if problem.extras.get(ZIGZAG_EXTRA, 1) > 1 and problem.q_len != problem.kv_len:
            return Support(False, "a zigzag-ordered sequence needs self-attention (q_len == kv_len)")
        return unknown_extras(problem, (ZIGZAG_EXTRA,))

    def __call__(
        self,
        problem: AttentionProblem,
        q,
        k,
        v,
        *,
        kv_mask=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        q_positions=None,
        kv_positions=None,
        bias=None,
        dropout_key=None,
    ):
        batch, q_len, num_heads, head_dim = q.shape
        kv_len, num_kv_heads = k.shape[1], k.shape[2]
        group = num_heads // num_kv_heads
        # Scores in float32 (backward matmuls in q's dtype: see `wide_result`).
        if group == 1:  # Plain multi-head: 4-D einsums (a size-1 group axis costs layout copies).
            logits = wide_result(functools.partial(jnp.einsum, "btnh,bsnh->bnts"), q, k, jnp.float32)
        else:  # Query head n reads kv head n // group, without materializing repeated k and v.
            q5 = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
            logits = wide_result(functools.partial(jnp.einsum, "btkgh,bskh->bkgts"), q5, k, jnp.float32)
            logits = logits.reshape(batch, num_heads, q_len, kv_len)
        logits = logits * problem.scale
        if problem.softcap is not None:
            logits = problem.softcap * jnp.tanh(logits / problem.softcap)
        if q_positions is None and (problem.bias_slopes is not None or problem.bias_fn is not None):
            q_positions = jnp.broadcast_to(jnp.arange(q_len), (batch, q_len))
            kv_positions = jnp.broadcast_to(jnp.arange(kv_len), (batch, kv_len))
        extra = position_bias(problem, q_positions, kv_positions)
        if extra is not None:
            logits = logits + extra
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        allowed = attention_mask(problem, kv_mask, q_segment_ids, kv_segment_ids)
        logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1)
        if problem.dropout_rate > 0.0 and dropout_key is not None:
            keep = jax.random.bernoulli(dropout_key, 1.0 - problem.dropout_rate, probs.shape)
            probs = jnp.where(keep, probs / (1.0 - problem.dropout_rate), 0.0)
        probs = probs.astype(v.dtype)
        if group == 1:
            return jnp.einsum("bnts,bsnh->btnh", probs, v)
        probs = probs.reshape(batch, num_kv_heads, group, q_len, kv_len)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
        return out.reshape(batch, q_len, num_heads, head_dim)


ATTENTION = Op("attention", AttentionProblem, XlaAttention(), "softmax(scale q.k + bias, masked) v with GQA.")
