"""Built-in plugin: the XLA reference kernels (always-available fallbacks) and the XLA:CPU linear kernel."""

from axcore.hookspecs import hookimpl
from axcore.kernels.attention import XlaAttention
from axcore.kernels.linear import LINEAR_OP, XlaCpuLinear, XlaLinear


@hookimpl
def axcore_register_attention_kernels(register):
    register(XlaAttention())


@hookimpl
def axcore_register_kernels(register):
    register(LINEAR_OP, XlaLinear())
    register(LINEAR_OP, XlaCpuLinear())
