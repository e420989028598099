"""Multi-head self-attention with grouped-query support and a position-embedding slot.

Projections: wq `[dim, heads, head_dim]`, wk/wv `[dim, kv_heads, head_dim]`,
wo `[heads, head_dim, dim]`. Scores go through the attention-kernel registry
(`axcore.kernels.attention`); the XLA reference kernel is the fallback.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, InstantiableConfig
from axcore.errors import ConfigError
from axcore.kernels.attention import ATTENTION_OP, AttentionProblem
from axcore.layers.base import BaseLayer, with_fields
from axcore.params import FanAxes, ParameterSpec


class MultiheadAttention(BaseLayer):
    """x `[batch, seq, input_dim]` -> `[batch, seq, input_dim]`."""

    class Config(BaseLayer.Config):
        """Configures MultiheadAttention."""

        # Model dimension.
        input_dim: int = REQUIRED
        # Number of query heads.
        num_heads: int = REQUIRED
        # Number of key/value heads: None = num_heads (MHA), 1 = multi-query, else grouped.
        num_kv_heads: int | None = None
        # Per-head dimension; None = input_dim // num_heads.
        head_dim: int | None = None
        # Whether query i may only attend to keys j <= i.
        causal: bool = False
        # Slot for a position embedding acting on queries/keys (a relative one); None = none.
        position_embedding: InstantiableConfig | None = None
        # Attention kernel to force by name; None = highest-priority kernel that supports the call.
        kernel: str | None = None
        # Softmax scale; None = 1 / sqrt(head_dim).
        scale: float | None = None

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        if cfg.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.path}: num_heads ({cfg.num_heads}) must be a multiple of "
                f"num_kv_heads ({cfg.num_kv_heads})."
            )
        if cfg.position_embedding is not None:
            self._add_child(
                "position_embedding",
                with_fields(cfg.position_embedding, dim=self.head_dim, num_heads=cfg.num_heads),
            )

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_kv_heads or self._config.num_heads

    @property
    def head_dim(self) -> int:
        return self._config.head_dim or self._config.input_dim // self._config.num_heads

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        d, n, k, h = cfg.input_dim, cfg.num_heads, self.num_kv_heads, self.head_dim
        proj = FanAxes((0,), (1, 2))
        return {
            "wq": self._weight((d, n, h), ("embed", "heads", None), proj),
            "wk": self._weight((d, k, h), ("embed", "kv_heads", None), proj),
            "wv": self._weight((d, k, h), ("embed", "kv_heads", None), proj),
            "wo": self._weight((n, h, d), ("heads", None, "embed"), FanAxes((0, 1), (2,))),
        }

    def forward(
        self,
        x: jax.Array,
        *,
        positions: jax.Array | None = None,
        kv_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Self-attention.

        Args:
            x: `[batch, seq, input_dim]`.
            positions: `[batch, seq]` int positions; default `arange(seq)`.
            kv_mask: `[batch, seq]` bool, False for padding keys; default all valid.
        """
        params = self.parameters
        dtype = x.dtype
        q = jnp.einsum("btd,dnh->btnh", x, params["wq"].astype(dtype))
        k = jnp.einsum("btd,dnh->btnh", x, params["wk"].astype(dtype))
        v = jnp.einsum("btd,dnh->btnh", x, params["wv"].astype(dtype))
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        bias = None
        if "position_embedding" in self.children:
            q, k = self.position_embedding.transform_qk(q, k, positions, positions)
            bias = self.position_embedding.attention_bias(positions, positions)
        out = self.attend(q, k, v, bias=bias, kv_mask=kv_mask)
        return jnp.einsum("btnh,nhd->btd", out, params["wo"].astype(dtype))

    def attend(self, q, k, v, *, bias=None, kv_mask=None) -> jax.Array:
        """Runs the selected attention kernel on projected q, k, v (see kernels.attention)."""
        cfg = self._config
        problem = AttentionProblem.of(q, k, causal=cfg.causal, bias=bias, kv_mask=kv_mask)
        kernel = self.registries.kernels.select(ATTENTION_OP, problem, requested=cfg.kernel)
        scale = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(self.head_dim)
        return kernel(q, k, v, causal=cfg.causal, bias=bias, kv_mask=kv_mask, scale=scale)
