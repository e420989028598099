"""axcore-sinusoidal: the sinusoidal absolute position embedding of "Attention Is All You Need".

An example third-party plugin, written only against axcore's documented API. Enable
it with `plugins: [sinusoidal]`; importing this package registers nothing, axcore
calls the hooks in `axcore_sinusoidal.plugin`.
"""

from axcore_sinusoidal.layer import SinusoidalPositionEmbedding, SinusoidalSettings, sinusoidal_config

__all__ = ["SinusoidalPositionEmbedding", "SinusoidalSettings", "sinusoidal_config"]
