"""`xla_cpu_decode`: the `paged_attention` op's kernel for decode steps on XLA:CPU.

A decode step gives each row one new token (`q_len == 1`). The reference kernel computes
its logits as a dot batched over rows and kv heads (`[group, head_dim] x [head_dim,
slots]` each), which XLA:CPU runs as many tiny matrix products, and transposes the
gathered keys and values for them; on a 2-core CPU that made attention two thirds of a
32-row decode step of a 135M model (`benchmarks/engine_decode_cpu.py`). This kernel uses
products batched over rows only, on the gathered blocks in the cache's own layout:

- logits: `[slots * kv_heads, head_dim] x [head_dim, heads]` per row (every query head
  against every kv head), then each query head keeps its own kv head's column;
- output: `[heads, slots] x [slots, kv_heads * head_dim]` per row, then each query head
  keeps its own kv head's block.

Both compute `num_kv_heads` times the needed products (tiny next to the memory they read),
so the kernel declines problems with more than `MAX_KV_HEADS` kv heads (measured, 32 rows x
512 slots, head_dim 64, on a 2-core CPU: 0.90x the reference's time at 1 kv head, 0.65x at
3, 0.59x at 4, 0.85x at 8; more were not measured). Same results as the reference up to float rounding (softmax in float32,
window, soft-cap, ALiBi slopes and `bias_fn` biases, GQA/MQA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axcore.kernels.paged_attention import PagedAttentionProblem, gather_blocks
from axcore.kernels.registry import Support, unknown_extras

# Most kv heads the kernel takes: its products do num_kv_heads x the needed work.
MAX_KV_HEADS = 8


def _own_kv_head(x: jax.Array, first: int, second: int) -> jax.Array:
    """The diagonal of two kv-head axes (`first < second`, the same length): `out[..., k, ...]` (k at
    `first`) is `x` at k on both; the `second` axis is dropped."""
    picks = [jnp.take(jnp.take(x, j, axis=second), j, axis=first) for j in range(x.shape[first])]
    return jnp.stack(picks, axis=first)


class XlaCpuPagedDecode:
    """Paged attention of one new token per row on XLA:CPU (module docstring).

    q `[batch, 1, heads, head_dim]`, the cache `[num_blocks, block_size, kv_heads, head_dim]`,
    block tables `[batch, max_blocks]`, positions `[batch, 1]` -> `[batch, 1, heads, head_dim]`.
    """

    name = "xla_cpu_decode"
    # Above the reference (0): on the CPU, decode steps use it unless a kernel is named.
    priority = 10

    def is_supported(self, problem: PagedAttentionProblem) -> Support:
        if problem.platform != "cpu":
            return Support(False, f"only for the cpu platform, not {problem.platform}")
        if problem.q_len != 1:
            return Support(False, f"decode steps only (one new token per row), not q_len {problem.q_len}")
        if problem.num_heads % problem.num_kv_heads:
            return Support(False, "num_heads must be a multiple of num_kv_heads")
        if problem.num_kv_heads > MAX_KV_HEADS:
            return Support(False, f"{problem.num_kv_heads} kv heads: it computes every query head against every "
                           f"kv head, more work than the reference past {MAX_KV_HEADS}")
        return unknown_extras(problem)

    def __call__(self, problem: PagedAttentionProblem, q, key, value, block_tables, positions, num_new):
        del num_new  # Padding rows attend at their (ignored) positions: finite garbage, as the reference.
        batch, _, num_heads, head_dim = q.shape
        num_kv, group = problem.num_kv_heads, num_heads // problem.num_kv_heads
        keys = gather_blocks(key, block_tables)  # [b, s, kv, h]
        slots = keys.shape[1]
        values = gather_blocks(value, block_tables).reshape(batch, slots, num_kv * head_dim)
        every = jnp.einsum("bnh,bmh->bmn", q[:, 0], keys.reshape(batch, slots * num_kv, head_dim),
                           preferred_element_type=jnp.float32)  # [b, s * kv', kv * g]
        logits = _own_kv_head(every.reshape(batch, slots, num_kv, num_kv, group), 2, 3)  # [b, s, kv, g]
        logits = logits.reshape(batch, slots, num_heads) * problem.scale
        if problem.softcap is not None:
            logits = problem.softcap * jnp.tanh(logits / problem.softcap)
        here = positions[:, :1]  # [b, 1]
        kv_positions = jnp.arange(slots)[None, :]
        if problem.bias_slopes is not None:
            distance = jnp.abs(here - kv_positions).astype(jnp.float32)  # [b, s]
            logits = logits - distance[:, :, None] * jnp.asarray(problem.bias_slopes, jnp.float32)
        elif problem.bias_fn is not None:
            bias = problem.bias_fn(here, jnp.broadcast_to(kv_positions, (batch, slots))).astype(jnp.float32)
            logits = logits + jnp.broadcast_to(bias, (batch, num_heads, 1, slots))[:, :, 0].transpose(0, 2, 1)
        allowed = kv_positions <= here
        if problem.sliding_window is not None:
            allowed = allowed & (here - kv_positions < problem.sliding_window)
        logits = jnp.where(allowed[:, :, None], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=1).astype(values.dtype).transpose(0, 2, 1)  # [b, n, s]
        out = jnp.einsum("bns,bsm->bnm", probs, values)  # [b, kv * g, kv' * h]
        out = _own_kv_head(out.reshape(batch, num_kv, group, num_kv, head_dim), 1, 3)  # [b, kv, g, h]
        return out.reshape(batch, 1, num_heads, head_dim).astype(q.dtype)
