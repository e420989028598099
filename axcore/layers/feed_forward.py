"""Position-wise feed-forward layer, plain or gated (GLU variants such as SwiGLU)."""

from __future__ import annotations

import enum

import jax

from axcore.config import REQUIRED
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


class Gating(enum.Enum):
    # down(act(up(x))).
    NONE = "none"
    # down(act(gate(x)) * up(x)): GEGLU with GELU, SwiGLU with SiLU.
    GATED = "gated"


class FeedForward(BaseLayer):
    """x `[..., input_dim]` -> `[..., input_dim]` through a hidden layer of `hidden_dim`."""

    class Config(BaseLayer.Config):
        """Configures FeedForward."""

        # Model dimension (input and output).
        input_dim: int = REQUIRED
        # Hidden dimension.
        hidden_dim: int = REQUIRED
        # Nonlinearity applied to the (gate) projection.
        activation: Activation = Activation.GELU
        # Plain or gated hidden layer.
        gating: Gating = Gating.NONE
        # Template for the projections (dimensions and axes are set by this layer).
        linear: Linear.Config = Linear.default_config().set(bias=False)

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        up = cfg.linear.clone(input_dim=cfg.input_dim, output_dim=cfg.hidden_dim, weight_axes=("embed", "mlp"))
        if cfg.gating is Gating.GATED:
            self._add_child("gate_proj", up)
        self._add_child("up_proj", up)
        down = cfg.linear.clone(input_dim=cfg.hidden_dim, output_dim=cfg.input_dim, weight_axes=("mlp", "embed"))
        self._add_child("down_proj", down)

    def forward(self, x: jax.Array) -> jax.Array:
        act = activation_fn(self._config.activation)
        if self._config.gating is Gating.GATED:
            hidden = act(self.gate_proj(x)) * self.up_proj(x)
        else:
            hidden = act(self.up_proj(x))
        return self.down_proj(hidden)
