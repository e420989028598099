"""Position-wise feed-forward layer: `down(act(up(x)))`."""

from __future__ import annotations

from typing import Annotated
import enum

import jax

from axcore.config import REQUIRED, Positive
from axcore.layers.base import BaseLayer
from axcore.layers.basic import Linear


class Activation(enum.Enum):
    RELU = "relu"
    # Exact (erf) GELU.
    GELU = "gelu"
    # tanh approximation of GELU.
    GELU_TANH = "gelu_tanh"
    SILU = "silu"


def activation_fn(activation: Activation):
    """The elementwise function for `activation`."""
    return {
        Activation.RELU: jax.nn.relu,
        Activation.GELU: lambda x: jax.nn.gelu(x, approximate=False),
        Activation.GELU_TANH: lambda x: jax.nn.gelu(x, approximate=True),
        Activation.SILU: jax.nn.silu,
    }[activation]


# Logical axes of the hidden activation `[batch, seq, hidden_dim]` (its sharding constraint).
HIDDEN_AXES = ("batch", "seq", "mlp")


def projection_configs(cfg: FeedForward.Config) -> tuple[Linear.Config, Linear.Config]:
    """The `[input_dim -> hidden_dim]` and `[hidden_dim -> input_dim]` Linear configs of a feed-forward
    config, from its `linear` template, with the weights' and inputs' logical axes."""
    up = cfg.linear.clone(
        input_dim=cfg.input_dim, output_dim=cfg.hidden_dim, weight_axes=("embed", "mlp"), input_axes=("batch", "seq", "embed")
    )
    down = cfg.linear.clone(
        input_dim=cfg.hidden_dim, output_dim=cfg.input_dim, weight_axes=("mlp", "embed"), input_axes=("batch", "seq", "mlp")
    )
    return up, down


class FeedForward(BaseLayer):
    """x `[..., input_dim]` -> `down(act(up(x)))` `[..., input_dim]`, hidden layer of `hidden_dim`."""

    class Config(BaseLayer.Config):
        """Configures FeedForward."""

        # Model dimension (input and output).
        input_dim: Annotated[int, Positive] = REQUIRED
        # Hidden dimension.
        hidden_dim: Annotated[int, Positive] = REQUIRED
        # Nonlinearity applied to the hidden layer.
        activation: Activation = Activation.GELU
        # Template for the projections (dimensions and axes are set by this layer).
        linear: Linear.Config = Linear.default_config().set(bias=False)

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        up, down = projection_configs(self._config)
        self._add_child("up_proj", up)
        self._add_child("down_proj", down)

    def forward(self, x: jax.Array) -> jax.Array:
        act = activation_fn(self._config.activation)
        return self.down_proj(self._constrain(act(self.up_proj(x)), HIDDEN_AXES))
