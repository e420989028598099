"""Position embeddings and the slot contract they implement.

A position embedding is a layer that may act in up to three places; each default
is the identity, so an embedding implements only what it needs:

- `embed_inputs(x, positions)`: absolute embeddings added to token embeddings, in a
  model's input slot (`CausalLM.position_embedding`).
- `transform_qk(q, k, q_positions, k_positions)`: relative embeddings that rotate or
  otherwise transform queries and keys (relative embeddings), in an attention layer's slot.
- `bias_slopes()`: per-head slopes of a linear distance bias `-slope_h * |i - j|`
  (ALiBi); the attention kernel computes the bias itself, so flash-style kernels
  keep working.
- `attention_bias(q_positions, k_positions)`: any other additive logit bias, given
  to the attention kernel as a function of positions (kernels that cannot call it
  decline, and the reference kernel computes it densely).

The parent sets `dim` (model dim in an input slot, head dim in an attention slot)
and `num_heads` (attention slots only).
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, AtLeastSetting, Length, Width
from axcore.layers.base import BaseLayer
from axcore.params import FanAxes, ParameterSpec


class PositionEmbedding(BaseLayer):
    """Base class of position embeddings (identity in every place)."""

    class Config(BaseLayer.Config):
        """Configures PositionEmbedding."""

        # Feature dimension it acts on; set by the parent slot.
        dim: Annotated[int, Width] | None = None
        # Number of query heads; set by attention slots.
        num_heads: Annotated[int, Width] | None = None

    def embed_inputs(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x `[batch, seq, dim]`, positions `[batch, seq]` int -> `[batch, seq, dim]`."""
        del positions
        return x

    def transform_qk(self, q, k, q_positions, k_positions):
        """q `[batch, q_len, heads, head_dim]`, k `[batch, kv_len, kv_heads, head_dim]`,
        positions `[batch, q_len]` / `[batch, kv_len]` -> `(q, k)` of the same shapes."""
        del q_positions, k_positions
        return q, k

    def bias_slopes(self):
        """-> `[num_heads]` slopes of the bias `-slope_h * |q_pos - k_pos|`, or None (no such bias)."""
        return None

    def attention_bias(self, q_positions, k_positions):
        """-> additive bias `[batch|1, heads|1, q_len, kv_len]`, or None. Used only when
        a subclass overrides it and `bias_slopes()` is None."""
        del q_positions, k_positions
        return None


class LearnedPositionEmbedding(PositionEmbedding):
    """Learned absolute embeddings: x + table[positions]; table `[max_len, dim]`."""

    class Config(PositionEmbedding.Config):
        """Configures LearnedPositionEmbedding."""

        # Number of positions the table holds; longer inputs are an error.
        max_len: Annotated[int, Length, AtLeastSetting("input.seq_len", "it holds one entry per position")] = REQUIRED

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        if cfg.dim is None:
            raise ValueError(f"{self.path}: dim is unset; place it in a slot that sets it.")
        return {"weight": self._weight((cfg.max_len, cfg.dim), (None, "embed"), FanAxes((1,), (0,)))}

    def embed_inputs(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        if x.shape[-2] > self._config.max_len:
            raise ValueError(
                f"{self.path}: sequence length {x.shape[-2]} exceeds max_len {self._config.max_len}."
            )
        table = self._constrain(self.parameters["weight"], (None, None))  # Gathered whole, as Embedding's rows.
        return x + jnp.take(table, positions, axis=0).astype(x.dtype)
