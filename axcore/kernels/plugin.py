"""Built-in plugin: the XLA reference attention kernel (always-available fallback)."""

from axcore.hookspecs import hookimpl
from axcore.kernels.attention import XlaAttention


@hookimpl
def axcore_register_attention_kernels(register):
    register(XlaAttention())
