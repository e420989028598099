"""Built-in plugin: the `dot`, `attention`, `paged_attention` and `rms_norm` ops (with their XLA reference kernels)
and the XLA:CPU dot kernel."""

from axcore.kernels.attention import ATTENTION
from axcore.kernels.attention_context import CONTEXT_KERNELS
from axcore.kernels.dot import DOT, XlaCpuDot
from axcore.kernels.norm import RMS_NORM
from axcore.kernels.paged_attention import PAGED_ATTENTION
from axcore.markers import hookimpl


@hookimpl
def axcore_register_ops(register):
    register(DOT)
    register(ATTENTION)
    register(PAGED_ATTENTION)
    register(RMS_NORM)


@hookimpl
def axcore_register_kernels(register):
    register(DOT, XlaCpuDot())


@hookimpl
def axcore_register_attention_kernels(register):
    for kernel in CONTEXT_KERNELS:
        register(kernel)
