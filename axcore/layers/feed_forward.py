"""Position-wise feed-forward layer: `down(act(up(x)))`.

Public parameter names (children built from the `linear` template): `up_proj/weight`
`[input_dim, hidden_dim]` (logical axes `embed, mlp`) and `down_proj/weight`
`[hidden_dim, input_dim]` (`mlp, embed`), plus `up_proj/bias` `[hidden_dim]` and
`down_proj/bias` `[input_dim]` where `linear.bias` is true.

The forward is three named steps, public methods a subclass may override:
`project_up(x)` -> `[..., hidden_dim]`, `activate(h)` (the nonlinearity) and
`project_down(h)` -> `[..., input_dim]`.
"""

from __future__ import annotations

import enum
from typing import Annotated

import jax

from axcore.config import REQUIRED, Width
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
        input_dim: Annotated[int, Width] = REQUIRED
        # Hidden dimension.
        hidden_dim: Annotated[int, Width] = REQUIRED
        # Nonlinearity applied to the hidden layer.
        activation: Activation = Activation.GELU
        # Template for the projections (dimensions and axes are set by this layer).
        linear: Linear.Config = Linear.default_config().set(bias=False)

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        up, down = projection_configs(self._config)
        self.add_child("up_proj", up)
        self.add_child("down_proj", down)

    def forward(self, x: jax.Array) -> jax.Array:
        """x `[..., input_dim]` -> `project_down(activate(project_up(x)))` `[..., input_dim]`."""
        return self.project_down(self.activate(self.project_up(x)))

    def project_up(self, x: jax.Array) -> jax.Array:
        """Step 1, the `up_proj` child: x `[..., input_dim]` -> pre-activation `[..., hidden_dim]`."""
        return self.up_proj(x)

    def activate(self, h: jax.Array) -> jax.Array:
        """Step 2, the `activation` nonlinearity, elementwise: `[..., hidden_dim]` -> the same shape."""
        return activation_fn(self._config.activation)(h)

    def project_down(self, h: jax.Array) -> jax.Array:
        """Step 3, the `down_proj` child: h `[..., hidden_dim]` (sharding-constrained by `HIDDEN_AXES`)
        -> `[..., input_dim]`."""
        return self.down_proj(self._constrain(h, HIDDEN_AXES))
