"""Linear, Embedding, RMSNorm and LayerNorm."""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, DType, Floating, Length, Positive, Width
from axcore.errors import ConfigError
from axcore.kernels.norm import RMS_NORM, rms_norm_problem
from axcore.kernels.registry import current_environment
from axcore.layers.base import BaseLayer, DotSite
from axcore.params import FanAxes, ParameterSpec


class Linear(BaseLayer):
    """y = x @ weight + bias. x `[..., input_dim]` -> y `[..., output_dim]`."""

    class Config(BaseLayer.Config):
        """Configures Linear."""

        # Size of the last input dimension.
        input_dim: Annotated[int, Length] = REQUIRED
        # Size of the last output dimension (a vocabulary, for an output head).
        output_dim: Annotated[int, Length] = REQUIRED
        # Whether to add a bias.
        bias: bool = True
        # Logical axis names of the weight `[input_dim, output_dim]`.
        weight_axes: tuple[str | None, str | None] = (None, None)
        # Logical axes of x, e.g. [batch, seq, embed] (tells kernels x's partition spec); None = unknown.
        input_axes: tuple[str | None, ...] | None = None
        # Dtype of y; None = the compute dtype (an output head sets float32 logits).
        output_dtype: Annotated[DType, Floating] | None = None

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        specs = {
            "weight": self._weight(
                (cfg.input_dim, cfg.output_dim), cfg.weight_axes, FanAxes((0,), (1,))
            )
        }
        if cfg.bias:
            specs["bias"] = self._constant((cfg.output_dim,), 0.0, (cfg.weight_axes[1],))
        return specs

    def _dot_sites(self) -> dict[str, DotSite]:
        return {"dot": DotSite("weight", (0,), self._config.output_dtype, x_axes=self._config.input_axes)}

    def forward(self, x: jax.Array) -> jax.Array:
        y = self._dot("dot", x)
        if "bias" in self.parameters:
            y = y + self.parameters["bias"].astype(y.dtype)
        return y


class Embedding(BaseLayer):
    """Token embedding: ids `[...]` -> `[..., dim]`; `attend` gives tied logits."""

    class Config(BaseLayer.Config):
        """Configures Embedding."""

        # Vocabulary size.
        num_embeddings: Annotated[int, Length] = REQUIRED
        # Embedding dimension.
        dim: Annotated[int, Width] = REQUIRED
        # Whether `attend` (logits against the table, a tied output head) is used; a model sets it.
        tied_head: bool = False

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        # fan_in is the embedding dimension: default std is 1/sqrt(dim).
        return {
            "weight": self._weight((cfg.num_embeddings, cfg.dim), ("vocab", "embed"), FanAxes((1,), (0,)))
        }

    def _dot_sites(self) -> dict[str, DotSite]:
        if not self._config.tied_head:
            return {}  # No output-head matmul, so no kernel state for one.
        return {"attend": DotSite("weight", (1,), "float32", x_axes=("batch", "seq", "embed"))}

    def forward(self, ids: jax.Array) -> jax.Array:
        """ids `[...]` int -> `[..., dim]` in the compute dtype.

        Under a mesh the table's embed dim is gathered first (FSDP-style): a gather from a
        table split on embed gives rows split on embed, which XLA cannot cheaply reshard to
        the batch-split activations that follow.
        """
        table = self._constrain(self.parameters["weight"], ("vocab", None))
        return jnp.take(table, ids, axis=0).astype(self.compute_dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Float32 logits against the embedding table: `[..., dim]` -> `[..., num_embeddings]`."""
        if not self._config.tied_head:
            raise ConfigError(f"{self.path}: attend() needs tied_head: true (it declares the output-head matmul).")
        return self._dot("attend", x)


class RMSNorm(BaseLayer):
    """x / sqrt(mean(x^2) + eps) * (scale_offset + scale) over the last axis, computed in float32.

    With `scale_offset` 1 the learned `scale` is a deviation from a gain of 1 (`x * (1 + w)`,
    a zero-centred gain); it starts at `1 - scale_offset`, so every norm starts with a gain of 1.

    Runs through the `rms_norm` op (`axcore.kernels.norm`): `kernels: {rms_norm: NAME}` on
    this layer or an ancestor forces a kernel (`xla`, the reference, computes the formula
    above in jax.numpy). x's partition spec is unknown to the kernels (None in the problem).
    """

    class Config(BaseLayer.Config):
        """Configures RMSNorm."""

        # Size of the normalized (last) dimension.
        input_dim: Annotated[int, Width] = REQUIRED
        # Added to the mean square for numerical stability.
        eps: Annotated[float, Positive] = 1e-6
        # Added to the learned scale (in float32) before it multiplies: 1 gives x * (1 + scale).
        scale_offset: float = 0.0

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        # Logical axis "norm" (replicated by default): a few bytes, read by every shard.
        return {"scale": self._constant((self._config.input_dim,), 1.0 - self._config.scale_offset, ("norm",))}

    def forward(self, x: jax.Array) -> jax.Array:
        """x `[..., input_dim]` -> the same shape and dtype, through the selected `rms_norm` kernel."""
        scale = self.parameters["scale"]
        if self._config.scale_offset != 0.0:
            scale = scale.astype(jnp.float32) + self._config.scale_offset
        problem = rms_norm_problem(
            x,
            scale,
            eps=self._config.eps,
            site=self.path,
            extras=self.op_extras(RMS_NORM),
            mesh=current_environment().mesh,
            input_specs=self._input_specs((None, x), (("norm",), scale)),
        )
        return self._select(RMS_NORM, problem)(problem, x, scale)


class LayerNorm(BaseLayer):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32."""

    class Config(BaseLayer.Config):
        """Configures LayerNorm."""

        # Size of the normalized (last) dimension.
        input_dim: Annotated[int, Width] = REQUIRED
        # Added to the variance for numerical stability.
        eps: Annotated[float, Positive] = 1e-5
        # Whether to add a learned bias after scaling.
        bias: bool = True

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        dim = self._config.input_dim
        specs = {"scale": self._constant((dim,), 1.0, ("norm",))}  # Replicated by default, as in RMSNorm.
        if self._config.bias:
            specs["bias"] = self._constant((dim,), 0.0, ("norm",))
        return specs

    def forward(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self._config.eps) * self.parameters["scale"].astype(jnp.float32)
        if self._config.bias:
            y = y + self.parameters["bias"].astype(jnp.float32)
        return y.astype(x.dtype)
