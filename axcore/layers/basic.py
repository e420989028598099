"""Linear, Embedding, RMSNorm and LayerNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED
from axcore.kernels.linear import LINEAR_OP, LinearProblem
from axcore.layers.base import BaseLayer
from axcore.params import FanAxes, ParameterSpec


class Linear(BaseLayer):
    """y = x @ weight + bias. x `[..., input_dim]` -> y `[..., output_dim]`."""

    class Config(BaseLayer.Config):
        """Configures Linear."""

        # Size of the last input dimension.
        input_dim: int = REQUIRED
        # Size of the last output dimension.
        output_dim: int = REQUIRED
        # Whether to add a bias.
        bias: bool = True
        # Logical axis names of the weight `[input_dim, output_dim]`.
        weight_axes: tuple[str | None, str | None] = (None, None)
        # Linear kernel to force by name; None = highest-priority kernel that supports the call.
        kernel: str | None = None

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

    def forward(self, x: jax.Array) -> jax.Array:
        params = self.parameters
        weight = params["weight"].astype(x.dtype)
        kernel = self.registries.kernels.select(LINEAR_OP, LinearProblem.of(x, weight), requested=self._config.kernel)
        y = kernel(x, weight)
        if "bias" in params:
            y = y + params["bias"].astype(x.dtype)
        return y


class Embedding(BaseLayer):
    """Token embedding: ids `[...]` -> `[..., dim]`; `attend` gives tied logits."""

    class Config(BaseLayer.Config):
        """Configures Embedding."""

        # Vocabulary size.
        num_embeddings: int = REQUIRED
        # Embedding dimension.
        dim: int = REQUIRED

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        # fan_in is the embedding dimension: default std is 1/sqrt(dim).
        return {
            "weight": self._weight((cfg.num_embeddings, cfg.dim), ("vocab", "embed"), FanAxes((1,), (0,)))
        }

    def forward(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.parameters["weight"], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding table: `[..., dim]` -> `[..., num_embeddings]`."""
        return jnp.einsum("...d,vd->...v", x, self.parameters["weight"].astype(x.dtype))


class RMSNorm(BaseLayer):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis, computed in float32."""

    class Config(BaseLayer.Config):
        """Configures RMSNorm."""

        # Size of the normalized (last) dimension.
        input_dim: int = REQUIRED
        # Added to the mean square for numerical stability.
        eps: float = 1e-6

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        return {"scale": self._constant((self._config.input_dim,), 1.0, ("embed",))}

    def forward(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self._config.eps)
        return (y * self.parameters["scale"].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(BaseLayer):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32."""

    class Config(BaseLayer.Config):
        """Configures LayerNorm."""

        # Size of the normalized (last) dimension.
        input_dim: int = REQUIRED
        # Added to the variance for numerical stability.
        eps: float = 1e-5
        # Whether to add a learned bias after scaling.
        bias: bool = True

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        dim = self._config.input_dim
        specs = {"scale": self._constant((dim,), 1.0, ("embed",))}
        if self._config.bias:
            specs["bias"] = self._constant((dim,), 0.0, ("embed",))
        return specs

    def forward(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self._config.eps) * self.parameters["scale"]
        if self._config.bias:
            y = y + self.parameters["bias"]
        return y.astype(x.dtype)
