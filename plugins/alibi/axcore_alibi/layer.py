"""`AlibiBias`: the ALiBi additive attention bias as a position embedding.

Head h adds `-slope_h * |i - j|` to the logit of query position i and key position
j. This is the symmetric form; for the keys a causal query sees (j <= i) it equals
the paper's causal form `-slope_h * (i - j)`, and the attention layer masks the
future anyway, so causal models get exactly the paper's numbers (the reference code
adds `slope_h * j`, which differs by a per-query constant: the same softmax), while
a bidirectional layer still gets a bias that decays with distance either way.

Slopes (the reference implementation, github.com/ofirpress/attention_with_linear_biases):
for n a power of two, `slope_h = 2^(-8 (h + 1) / n)`, h = 0..n-1 (n=8: 1/2 ... 1/256).
Otherwise, with m the largest power of two below n, the m slopes of m followed by
the first n - m of every other slope of 2m: `2^(-8 (2k + 1) / (2m))`, k = 0..n-m-1.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from axcore.layers import PositionEmbedding


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi slope of each head, `[num_heads]` float64, geometric in h."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}.")
    m = 2 ** math.floor(math.log2(num_heads))
    slopes = 2.0 ** (-8.0 * np.arange(1, m + 1) / m)
    if m == num_heads:
        return slopes
    return np.concatenate([slopes, alibi_slopes(2 * m)[0::2][: num_heads - m]])


class AlibiBias(PositionEmbedding):
    """ALiBi for an attention slot: its `bias_slopes` go to the attention kernel as slopes."""

    def bias_slopes(self) -> np.ndarray:
        """`[num_heads]` ALiBi slopes (the attention op adds `-slope_h * |i - j|`)."""
        num_heads = self._config.num_heads
        if num_heads is None:
            raise ValueError(f"{self.path}: num_heads is unset; put AlibiBias in an attention slot.")
        return alibi_slopes(num_heads)

    def attention_bias(self, q_positions, k_positions):
        """q_positions `[batch, q_len]`, k_positions `[batch, kv_len]` int
        -> float32 bias `[batch, num_heads, q_len, kv_len]` = `-slope_h * |i - j|`."""
        num_heads = self._config.num_heads
        if num_heads is None:
            raise ValueError(f"{self.path}: num_heads is unset; put AlibiBias in an attention slot.")
        slopes = jnp.asarray(alibi_slopes(num_heads), jnp.float32)
        distance = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
        return -slopes[None, :, None, None] * distance[:, None, :, :]
