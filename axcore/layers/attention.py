"""Multi-head self-attention with grouped-query support and a position-embedding slot.

Projections (dot sites `q_proj`, `k_proj`, `v_proj`, `o_proj`): wq `[dim, heads,
head_dim]`, wk/wv `[dim, kv_heads, head_dim]`, wo `[heads, head_dim, dim]`. Scores go
through the `attention` op (`axcore.kernels.attention`); the XLA reference kernel is
the fallback. The forward is a sequence of named steps a subclass can replace:
`project_qkv`, the position embedding's `transform_qk`, `attend`, `project_output`.
"""

from __future__ import annotations

from typing import Annotated
import math

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, InstantiableConfig, Positive, Probability
from axcore.errors import ConfigError
from axcore.kernels.attention import ATTENTION, AttentionProblem
from axcore.kernels.registry import current_environment
from axcore.layers.base import BaseLayer, DotSite, with_fields
from axcore.layers.position import PositionEmbedding
from axcore.params import FanAxes, ParameterSpec, fold_in_name


# Logical axes of projected queries and keys/values `[batch, seq, heads, head_dim]`.
QKV_AXES = {"q": ("batch", "seq", "heads", None), "kv": ("batch", "seq", "kv_heads", None)}


class MultiheadAttention(BaseLayer):
    """x `[batch, seq, input_dim]` -> `[batch, seq, input_dim]`."""

    class Config(BaseLayer.Config):
        """Configures MultiheadAttention."""

        # Model dimension.
        input_dim: Annotated[int, Positive] = REQUIRED
        # Number of query heads.
        num_heads: Annotated[int, Positive] = REQUIRED
        # Number of key/value heads: None = num_heads (MHA), 1 = multi-query, else grouped.
        num_kv_heads: Annotated[int, Positive] | None = None
        # Per-head dimension; None = input_dim // num_heads.
        head_dim: Annotated[int, Positive] | None = None
        # Whether query i may only attend to keys j <= i.
        causal: bool = False
        # Query i sees only the keys fewer than this many positions behind it; None = all.
        sliding_window: Annotated[int, Positive] | None = None
        # Logit soft-cap c: logits = c * tanh(logits / c); None = none.
        softcap: Annotated[float, Positive] | None = None
        # Dropout rate on the attention probabilities, in training only.
        dropout_rate: Annotated[float, Probability] = 0.0
        # Slot for a position embedding acting on queries/keys (a relative one); None = none.
        position_embedding: InstantiableConfig | None = None
        # Attention kernel to force by name; None = highest-priority kernel that supports the call.
        kernel: str | None = None
        # Softmax scale; None = 1 / sqrt(head_dim).
        scale: Annotated[float, Positive] | None = None

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        if cfg.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.path}: num_heads ({cfg.num_heads}) must be a multiple of "
                f"num_kv_heads ({cfg.num_kv_heads})."
            )
        if cfg.head_dim is None and cfg.input_dim % cfg.num_heads:
            raise ConfigError(
                f"{self.path}: num_heads ({cfg.num_heads}) must divide the model dimension ({cfg.input_dim}), "
                f"or set head_dim explicitly."
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

    def _dot_sites(self) -> dict[str, DotSite]:
        x_axes = ("batch", "seq", "embed")
        return {
            "q_proj": DotSite("wq", x_axes=x_axes),
            "k_proj": DotSite("wk", x_axes=x_axes),
            "v_proj": DotSite("wv", x_axes=x_axes),
            "o_proj": DotSite("wo", (0, 1), x_axes=QKV_AXES["q"]),
        }

    def forward(
        self,
        x: jax.Array,
        *,
        positions: jax.Array | None = None,
        kv_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Self-attention.

        Args:
            x: `[batch, seq, input_dim]`.
            positions: `[batch, seq]` int positions; default `arange(seq)`.
            kv_mask: `[batch, seq]` bool, False for padding keys; default all valid.
            segment_ids: `[batch, seq]` int; tokens attend only within their segment
                (packed sequences); default one segment.
        """
        q, k, v = self.project_qkv(x)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        if "position_embedding" in self.children:
            q, k = self.position_embedding.transform_qk(q, k, positions, positions)
        out = self.attend(q, k, v, positions=positions, kv_mask=kv_mask, segment_ids=segment_ids)
        return self.project_output(out)

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x `[b, t, dim]` -> q `[b, t, heads, head_dim]`, k and v `[b, t, kv_heads, head_dim]`, each with a
        sharding constraint from its logical axes (`QKV_AXES`)."""
        q = self._constrain(self._dot("q_proj", x), QKV_AXES["q"])
        k = self._constrain(self._dot("k_proj", x), QKV_AXES["kv"])
        return q, k, self._constrain(self._dot("v_proj", x), QKV_AXES["kv"])

    def project_output(self, out: jax.Array) -> jax.Array:
        """`[b, t, heads, head_dim]` (constrained like q) -> `[b, t, dim]`."""
        return self._dot("o_proj", self._constrain(out, QKV_AXES["q"]))

    def attend(self, q, k, v, *, positions=None, kv_mask=None, segment_ids=None) -> jax.Array:
        """Runs the selected attention kernel on projected q, k, v (see kernels.attention)."""
        cfg = self._config
        slopes, bias_fn = None, None
        if "position_embedding" in self.children:
            embedding = self.position_embedding
            found = embedding.bias_slopes()
            if found is not None:
                slopes = tuple(float(s) for s in found)
            elif type(embedding).attention_bias is not PositionEmbedding.attention_bias:
                bias_fn = embedding.attention_bias
        dropout = cfg.dropout_rate if self.is_training else 0.0
        problem = AttentionProblem.of(
            q,
            k,
            mesh=current_environment().mesh,
            input_specs=self._input_specs((QKV_AXES["q"], q), (QKV_AXES["kv"], k), (QKV_AXES["kv"], v)),
            extras=self.op_extras(ATTENTION),
            scale=cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(self.head_dim),
            causal=cfg.causal,
            sliding_window=cfg.sliding_window,
            has_segment_ids=segment_ids is not None,
            softcap=cfg.softcap,
            dropout_rate=dropout,
            bias_slopes=slopes,
            bias_fn=bias_fn,
            has_kv_mask=kv_mask is not None,
            site=f"{self.path}.attention",
        )
        kernel = self.registries.kernels.select(ATTENTION, problem, requested=cfg.kernel or self.kernel_choice(ATTENTION))
        inputs = {}
        if kv_mask is not None:
            inputs["kv_mask"] = kv_mask
        if segment_ids is not None:
            inputs["q_segment_ids"] = inputs["kv_segment_ids"] = segment_ids
        if slopes is not None or bias_fn is not None:
            inputs["q_positions"] = inputs["kv_positions"] = positions
        if dropout > 0.0:
            if self.prng_key is None:
                raise ValueError(f"{self.path}: attention dropout in training needs a prng_key.")
            inputs["dropout_key"] = fold_in_name(self.prng_key, "attention_dropout")
        return self._run_kernel(kernel, "attention", problem, q, k, v, **inputs)
