"""Built-in plugin: the `dot`, `attention`, `paged_attention` and `rms_norm` ops (with their XLA reference kernels),
the XLA:CPU dot kernel and the XLA:CPU paged decode kernel."""

from axcore.kernels.attention import ATTENTION
from axcore.kernels.attention_context import CONTEXT_KERNELS
from axcore.kernels.dot import DOT, XlaCpuDot
from axcore.kernels.norm import RMS_NORM
from axcore.kernels.paged_attention import PAGED_ATTENTION
from axcore.kernels.paged_decode_cpu import XlaCpuPagedDecode
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
    register(PAGED_ATTENTION, XlaCpuPagedDecode())


@hookimpl
def axcore_register_attention_kernels(register):
    for kernel in CONTEXT_KERNELS:
        register(kernel)
