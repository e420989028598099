"""axcore-cpu: CPU kernels for axcore's inference engine (the `cpu` hardware plugin).

Two `dot` kernels for the engine's programs on the CPU, where XLA:CPU's own matrix products
are slow for the few rows of a decode step: `cpu_rows` (AVX-512 CPUs), a product of our own
that reads each weight once in place, and `openblas` (other x86 CPUs), OpenBLAS's sgemm
(both XLA FFI calls, no copy); and `cpu_paged_decode`, a
`paged_attention` kernel for decode steps that reads each row's KV blocks in place (C++,
no gather). Importing this package loads nothing;
the native library is opened when the kernel first runs (`axcore_cpu.native`).
"""

from axcore_cpu.openblas_dot import OpenBlasDot
from axcore_cpu.paged_decode import CpuPagedDecode
from axcore_cpu.rows_dot import CpuRowsDot

__all__ = ["CpuPagedDecode", "CpuRowsDot", "OpenBlasDot"]
