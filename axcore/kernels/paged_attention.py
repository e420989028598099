"""The `paged_attention` op: attention of new tokens over a paged KV cache, and its XLA reference kernel.

The inference engine keeps each attention layer's keys and values in fixed-size blocks
shared by every sequence: `key` and `value` `[num_blocks, block_size, kv_heads, head_dim]`.
A sequence's block table lists its blocks in order, so the token at absolute position
`p` lives in block `table[p // block_size]` at offset `p % block_size`. Block 0 is the
null block: padding writes there and it never holds valid context.

A kernel is called as `kernel(problem, q, key, value, block_tables, positions, num_new)`:

- q `[batch, q_len, num_heads, head_dim]`: the queries of each row's new tokens
  (left-aligned; row b's first `num_new[b]` are valid);
- key, value `[num_blocks, block_size, num_kv_heads, head_dim]`: the layer's cache, the
  new tokens' keys and values already written;
- block_tables `[batch, max_blocks]` int32 (padded with 0);
- positions `[batch, q_len]` int32, the absolute position of each new token;
- num_new `[batch]` int32, valid tokens per row (0: an empty padding row).

Returns `[batch, q_len, num_heads, head_dim]` in q's dtype. Token (b, i) attends to the
slots of its sequence at positions `j <= positions[b, i]` (and `positions[b, i] - j <
sliding_window` with a window). Logits are `scale * q.k`, then `softcap * tanh(logits /
softcap)`, then the position bias (ALiBi slopes `-slope_h * |p - j|`, or `bias_fn(q_positions,
kv_positions)`), as in the `attention` op. GQA/MQA: query head n reads kv head
`n // (num_heads // num_kv_heads)`. Padding tokens (i >= num_new[b]) get finite values
nobody reads.

A kernel may declare `reads_blocks_in_place = True` when its cost does not grow with the
block tables' padded width (it reads each row's blocks through its table, up to the row's
position, and gathers nothing): the engine then runs each step ragged, one token per row
(`EngineConfig.ragged_steps`), which only such kernels make cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels.registry import Op, Problem, Support, current_platform, unknown_extras


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionProblem(Problem):
    """What a kernel needs to decide whether it can run a paged attention call."""

    # Rows of the padded step batch.
    batch: int
    # New tokens per row (padded).
    q_len: int
    # Query heads.
    num_heads: int
    # Key/value heads (num_heads is a multiple of it).
    num_kv_heads: int
    # Per-head dimension.
    head_dim: int
    # Blocks of the cache (block 0 the null block).
    num_blocks: int
    # Tokens per block.
    block_size: int
    # Width of the block tables: the most blocks one row may read.
    max_blocks: int
    # Dtype of q and of the cache (the compute dtype); softmax always runs in float32.
    dtype: np.dtype
    # Softmax scale applied to q.k.
    scale: float
    # Token at p sees the slot at j only if p - j < sliding_window; None = unlimited.
    sliding_window: int | None = None
    # Logit soft-cap `softcap * tanh(logits / softcap)`; None = none.
    softcap: float | None = None
    # ALiBi-style slopes, one per query head: bias `-slope_h * |q_pos - k_pos|`; None = none.
    bias_slopes: tuple[float, ...] | None = None
    # bias_fn(q_positions [b, t], kv_positions [b, s]) -> `[batch|1, heads|1, t, s]`; None = none.
    bias_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    # Dotted path of the call site.
    site: str = ""

    @classmethod
    def of(cls, q, key, block_tables, *, platform: str | None = None, **fields) -> PagedAttentionProblem:
        """The problem of q `[b, t, n, h]`, the cache's key `[blocks, block_size, kv, h]` and the block
        tables `[b, max_blocks]`; `fields` are the flags above (`scale` defaults to 1/sqrt(h))."""
        fields.setdefault("scale", 1.0 / float(np.sqrt(q.shape[3])))
        return cls(
            platform=platform or current_platform(),
            batch=q.shape[0],
            q_len=q.shape[1],
            num_heads=q.shape[2],
            num_kv_heads=key.shape[2],
            head_dim=q.shape[3],
            num_blocks=key.shape[0],
            block_size=key.shape[1],
            max_blocks=block_tables.shape[1],
            dtype=np.dtype(q.dtype),
            **fields,
        )


def gather_blocks(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Each row's blocks in table order: cache `[blocks, bs, kv, h]`, tables `[b, m]` -> `[b, m * bs, kv, h]`.

    Slot j of a row holds the token at position j of its sequence (where the table covers it).
    """
    gathered = jnp.take(cache, block_tables, axis=0)  # [b, m, bs, kv, h]
    b, m, bs = gathered.shape[:3]
    return gathered.reshape(b, m * bs, *cache.shape[2:])


def paged_slots(positions: jax.Array, num_new: jax.Array, block_tables: jax.Array, block_size: int) -> jax.Array:
    """`[batch, t]` int32 flat cache slots (`block * block_size + offset`) the new tokens write.

    Token (b, i) at position p writes slot `block_tables[b, p // block_size] * block_size + p % block_size`;
    a padding token (i >= num_new[b]) writes into the null block 0 (offset `p % block_size`).
    """
    t = positions.shape[1]
    valid = jnp.arange(t)[None, :] < num_new[:, None]
    index = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    block = jnp.take_along_axis(block_tables, index, axis=1)
    offset = positions % block_size
    return jnp.where(valid, block * block_size + offset, offset).astype(jnp.int32)


def write_paged(blocks: jax.Array, slots: jax.Array, update: jax.Array) -> jax.Array:
    """blocks `[num_blocks, block_size, kv, h]` with update `[b, t, kv, h]` (cast to their dtype) written at
    the flat slots `[b, t]` (`paged_slots`); under donation, in place.

    A single slot would make XLA turn the scatter into a dynamic-update-slice, which it may duplicate for
    its readers, copying the whole cache; a second write (the same values into slot 0 of the null block)
    keeps it a scatter.
    """
    slots = slots.reshape(-1)
    update = update.reshape(-1, *update.shape[2:]).astype(blocks.dtype)
    if slots.shape[0] == 1:
        slots, update = jnp.concatenate([slots, jnp.zeros((1,), slots.dtype)]), jnp.concatenate([update, update])
    flat = blocks.reshape(-1, *blocks.shape[2:])
    return flat.at[slots].set(update).reshape(blocks.shape)


def paged_mask(problem: PagedAttentionProblem, positions: jax.Array) -> jax.Array:
    """`[batch, 1, q_len, max_blocks * block_size]` bool: the gathered slots each new token may attend."""
    slots = jnp.arange(problem.max_blocks * problem.block_size)[None, None, :]
    here = positions[:, :, None]
    allowed = slots <= here
    if problem.sliding_window is not None:
        allowed = allowed & (here - slots < problem.sliding_window)
    return allowed[:, None]


class XlaPagedAttention:
    """Reference paged attention in plain jax.numpy: gathers each row's blocks, masks by position.

    Every capability of the problem; memory O(batch x heads x q_len x max_blocks x
    block_size) for the float32 logits. Rows whose slots are all masked give a uniform
    average (finite, never NaN).
    """

    name = "xla"
    # Lowest: every specialized kernel that supports a problem should win over it.
    priority = 0

    def is_supported(self, problem: PagedAttentionProblem) -> Support:
        if problem.num_heads % problem.num_kv_heads:
            return Support(False, "num_heads must be a multiple of num_kv_heads")
        return unknown_extras(problem)

    def __call__(self, problem: PagedAttentionProblem, q, key, value, block_tables, positions, num_new):
        del num_new  # Padding tokens attend like valid ones at their (ignored) positions: finite garbage.
        batch, q_len, num_heads, head_dim = q.shape
        k, v = gather_blocks(key, block_tables), gather_blocks(value, block_tables)
        kv_len, num_kv_heads = k.shape[1], k.shape[2]
        group = num_heads // num_kv_heads
        q5 = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
        logits = jnp.einsum("btkgh,bskh->bkgts", q5, k, preferred_element_type=jnp.float32)
        logits = logits.reshape(batch, num_heads, q_len, kv_len) * problem.scale
        if problem.softcap is not None:
            logits = problem.softcap * jnp.tanh(logits / problem.softcap)
        kv_positions = jnp.broadcast_to(jnp.arange(kv_len), (batch, kv_len))
        if problem.bias_slopes is not None:
            slopes = jnp.asarray(problem.bias_slopes, jnp.float32)
            distance = jnp.abs(positions[:, :, None] - kv_positions[:, None, :]).astype(jnp.float32)
            logits = logits - slopes[None, :, None, None] * distance[:, None]
        elif problem.bias_fn is not None:
            logits = logits + problem.bias_fn(positions, kv_positions).astype(jnp.float32)
        logits = jnp.where(paged_mask(problem, positions), logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        probs = probs.reshape(batch, num_kv_heads, group, q_len, kv_len)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
        return out.reshape(batch, q_len, num_heads, head_dim)


PAGED_ATTENTION = Op(
    "paged_attention",
    PagedAttentionProblem,
    XlaPagedAttention(),
    "softmax(scale q.k + bias, masked by position) v over a sequence's KV blocks, with GQA.",
)
