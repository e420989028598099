"""`SinusoidalPositionEmbedding`: fixed sine/cosine position encodings added to the token embeddings.

Vaswani et al. 2017 ("Attention Is All You Need", section 3.5), with d = dim, for a
token at position `pos` and feature pair i = 0 .. d/2 - 1:

    PE(pos, 2i)     = sin(pos / base^(2i / d))
    PE(pos, 2i + 1) = cos(pos / base^(2i / d))          base = 10000 in the paper

and the layer returns `x + PE(positions)`. It has no parameters. (For odd d the
last feature is a sine.) Frequencies are computed in float64, angles and the
sines in float32; the output has x's dtype.
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np

from axcore import ConfigBase
from axcore.config import Positive, Range
from axcore.layers import PositionEmbedding


class SinusoidalSettings(ConfigBase):
    """The user-facing fields of SinusoidalPositionEmbedding; also the plugin's `sinusoidal:` section."""

    # Base of the wavelengths: feature pair i turns at frequency base^(-2i/dim) (10000 in the paper).
    base: Annotated[float, Range(gt=1)] = 10000.0
    # Longest sequence accepted (longer inputs are an error); None = any length.
    max_len: Annotated[int, Positive] | None = None


def inverse_frequencies(dim: int, base: float) -> np.ndarray:
    """`[dim]` float64: feature j turns at base^(-2 floor(j/2) / dim) radians per position."""
    pair = np.arange(dim) // 2
    return base ** (-2.0 * pair / dim)


class SinusoidalPositionEmbedding(PositionEmbedding):
    """x `[batch, seq, dim]` + PE(positions) (module docstring); acts in a model's input slot only."""

    class Config(SinusoidalSettings, PositionEmbedding.Config):
        """Configures SinusoidalPositionEmbedding (the SinusoidalSettings fields plus the slot's dim)."""

    def embed_inputs(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x `[batch, seq, dim]`, positions `[batch, seq]` int -> `[batch, seq, dim]`."""
        cfg = self.config  # Public: a copy of the config the layer was built from.
        if cfg.max_len is not None and x.shape[-2] > cfg.max_len:
            raise ValueError(f"{self.path}: sequence length {x.shape[-2]} exceeds max_len {cfg.max_len}.")
        freqs = jnp.asarray(inverse_frequencies(x.shape[-1], cfg.base), jnp.float32)  # [dim]
        angles = positions.astype(jnp.float32)[..., None] * freqs  # [batch, seq, dim]
        even = (jnp.arange(x.shape[-1]) % 2) == 0
        table = jnp.where(even, jnp.sin(angles), jnp.cos(angles))
        return (x.astype(jnp.float32) + table).astype(x.dtype)


def sinusoidal_config(settings: SinusoidalSettings | None = None):
    """A SinusoidalPositionEmbedding config with the fields of `settings` (defaults if None)."""
    settings = settings if settings is not None else SinusoidalSettings()
    fields = {name: getattr(settings, name) for name in SinusoidalSettings().keys()}
    return SinusoidalPositionEmbedding.default_config().set(**fields)
