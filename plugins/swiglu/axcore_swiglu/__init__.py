"""axcore-swiglu: turns every FeedForward into a gated SiLU (SwiGLU) feed-forward.

Enable with `plugins: [swiglu]`; settings live under `swiglu:` (see `SwiGLUSettings`).
Importing this package registers nothing; axcore calls the hooks in `plugin`.
"""

from axcore_swiglu.layer import GatedFeedForward
from axcore_swiglu.plugin import SwiGLUSettings, gated_hidden_dim

__all__ = ["GatedFeedForward", "SwiGLUSettings", "gated_hidden_dim"]
