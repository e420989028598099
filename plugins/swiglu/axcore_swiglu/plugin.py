"""The swiglu plugin: the gated feed-forward layer, settings and the config transform.

SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"):
`FFN(x) = down(silu(x W_gate) * (x W_up))`. `plugins: [swiglu]` replaces every
core `feed_forward` config (also ones nested in other components, e.g. MoE experts)
with a `gated_feed_forward` (`GatedFeedForward`, registered by this plugin) carrying
the same field values, with `activation` from the settings.

A gated FFN has three `[dim, hidden]`-sized matrices instead of two, so at equal
`hidden_dim` it has 1.5x the parameters. `hidden_dim_multiplier` (e.g. 2/3, as in
LLaMA) shrinks the hidden layer to keep the count near the dense FFN's:

    hidden_dim' = multiple * ceil(multiplier * hidden_dim / multiple)

(LLaMA's rounding up to a multiple of `hidden_dim_multiple_of`; e.g. d=256,
hidden 1024, 2/3 -> 704.) Left None, `hidden_dim` is kept as configured.
"""

from __future__ import annotations

import math
from typing import Annotated

from axcore import REQUIRED, ConfigBase, hookimpl
from axcore.config import Positive, Width, is_config_of, replace
from axcore.errors import ConfigError
from axcore.layers import Activation, FeedForward

from axcore_swiglu.layer import GatedFeedForward


class SwiGLUSettings(ConfigBase):
    """Settings of the swiglu plugin (the experiment's `swiglu:` section)."""

    # Nonlinearity of the gate projection: silu gives SwiGLU (gelu gives GEGLU).
    activation: Activation = Activation.SILU
    # Scale applied to every FFN's hidden_dim (2/3 keeps the dense parameter count); None = keep.
    hidden_dim_multiplier: Annotated[float, Positive] | None = None
    # The scaled hidden_dim is rounded up to a multiple of this.
    hidden_dim_multiple_of: Annotated[int, Width] = 64


def gated_hidden_dim(hidden_dim: int, multiplier: float, multiple_of: int) -> int:
    """`multiple_of * ceil(multiplier * hidden_dim / multiple_of)` (at least `multiple_of`)."""
    if multiplier <= 0 or multiple_of < 1:
        raise ConfigError(
            f"swiglu: hidden_dim_multiplier ({multiplier}) must be positive and hidden_dim_multiple_of "
            f"({multiple_of}) at least 1."
        )
    return multiple_of * max(1, math.ceil(multiplier * hidden_dim / multiple_of - 1e-9))


def to_swiglu(path: str, ffn, settings: SwiGLUSettings):
    """A GatedFeedForward config with `ffn`'s (a FeedForward config at `path`) values and `settings`."""
    if is_config_of(ffn, GatedFeedForward):
        return ffn  # Installed already (a resolved config read back): not scaled twice.
    gated = GatedFeedForward.default_config().set(**dict(ffn.items()))
    gated.activation = settings.activation
    if settings.hidden_dim_multiplier is not None:
        if gated.hidden_dim is REQUIRED:
            raise ConfigError(
                f"swiglu.hidden_dim_multiplier is set but '{path or '<root>'}' has no hidden_dim (its "
                f"parent sets it, e.g. MoE experts); set it, unset the multiplier, or list swiglu before "
                f"the plugin that built the parent (plugins: [swiglu, moe])."
            )
        multiplier, multiple_of = settings.hidden_dim_multiplier, settings.hidden_dim_multiple_of
        gated.hidden_dim = gated_hidden_dim(gated.hidden_dim, multiplier, multiple_of)
    return gated


def _is_feed_forward(_path: str, node) -> bool:
    return is_config_of(node, FeedForward) or is_config_of(node, GatedFeedForward)


@hookimpl
def axcore_register_layers(register):
    register("gated_feed_forward", GatedFeedForward)


@hookimpl
def axcore_settings_config():
    return SwiGLUSettings()


@hookimpl
def axcore_transform_config(config, settings):
    # Every FeedForward, including ones nested in other components (e.g. MoE experts).
    return replace(config, _is_feed_forward, lambda path, ffn: to_swiglu(path, ffn, settings))
