"""The `cpu` plugin (entry point `cpu`): the inference engine's CPU kernels, `cpu_rows` and `openblas` (dot) and
`cpu_paged_decode`.

Installed, it autoloads everywhere and registers its kernels; the dot kernels decline
everything but float32 weight matmuls on the CPU inside forward-only programs (the
engine's), so training steps keep XLA's dot; the attention kernel serves the engine's
float32 decode steps on the CPU. Importing it opens no library.
"""

from axcore import hookimpl
from axcore.kernels import DOT, PAGED_ATTENTION

from axcore_cpu.openblas_dot import OpenBlasDot
from axcore_cpu.paged_decode import CpuPagedDecode
from axcore_cpu.rows_dot import CpuRowsDot


@hookimpl
def axcore_register_kernels(register):
    register(DOT, CpuRowsDot())
    register(DOT, OpenBlasDot())
    register(PAGED_ATTENTION, CpuPagedDecode())
