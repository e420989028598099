"""axcore-rope: rotary position embeddings as an axcore feature plugin.

Enable it in an experiment with `plugins: [rope]`; settings go under `rope:`.
"""

from axcore_rope.rotary import RotaryEmbedding, RotarySettings, Scaling, rotary_config, rotary_frequencies

__all__ = ["RotaryEmbedding", "RotarySettings", "Scaling", "rotary_config", "rotary_frequencies"]
