"""GatedFeedForward: `down(act(gate(x)) * up(x))`, the GLU family (SwiGLU with SiLU, GEGLU with GELU).

Shazeer 2020, "GLU Variants Improve Transformer". For x `[..., input_dim]`:

    hidden = act(x @ W_gate) * (x @ W_up)       [..., hidden_dim]
    y      = hidden @ W_down                    [..., input_dim]

Configured exactly like the core `FeedForward` (its config class is reused, so
every field carries over); the three projections are `Linear` layers built from
the `linear` template, named `gate_proj`, `up_proj` and `down_proj`.
"""

from __future__ import annotations

import jax

from axcore.layers import BaseLayer, FeedForward
from axcore.layers.feed_forward import HIDDEN_AXES, activation_fn, projection_configs


class GatedFeedForward(BaseLayer):
    """x `[..., input_dim]` -> `down(act(gate(x)) * up(x))` `[..., input_dim]`."""

    class Config(FeedForward.Config):
        """Configures GatedFeedForward: FeedForward's fields; `activation` applies to the gate."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        up, down = projection_configs(self._config)
        self._add_child("gate_proj", up)
        self._add_child("up_proj", up)
        self._add_child("down_proj", down)

    def forward(self, x: jax.Array) -> jax.Array:
        act = activation_fn(self._config.activation)
        hidden = act(self.gate_proj(x)) * self.up_proj(x)  # Sharding-constrained like FeedForward's hidden.
        return self.down_proj(self._constrain(hidden, HIDDEN_AXES))
