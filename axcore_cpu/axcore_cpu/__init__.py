"""axcore-cpu: CPU kernels for axcore's inference engine (the `cpu` hardware plugin).

`openblas`, a `dot` kernel for the engine's programs on the CPU: XLA:CPU's own matrix
products are slow for the few rows of a decode step, so the engine's weight matmuls run
through OpenBLAS's sgemm (an XLA FFI call, no copy); and `cpu_paged_decode`, a
`paged_attention` kernel for decode steps that reads each row's KV blocks in place (C++,
no gather). Importing this package loads nothing;
the native library is opened when the kernel first runs (`axcore_cpu.native`).
"""

from axcore_cpu.openblas_dot import OpenBlasDot
from axcore_cpu.paged_decode import CpuPagedDecode

__all__ = ["CpuPagedDecode", "OpenBlasDot"]
