"""Built-in plugin: the `dot` and `attention` ops (with their XLA reference kernels) and the XLA:CPU dot kernel."""

from axcore.kernels.attention import ATTENTION
from axcore.kernels.dot import DOT, XlaCpuDot
from axcore.markers import hookimpl


@hookimpl
def axcore_register_ops(register):
    register(DOT)
    register(ATTENTION)


@hookimpl
def axcore_register_kernels(register):
    register(DOT, XlaCpuDot())
