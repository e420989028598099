"""Builds axcore-cpu's one native library: XLA FFI handlers compiled against jaxlib's FFI headers."""

import os
import platform

import jaxlib
from setuptools import Extension, setup


def vector_flags() -> list[str]:
    """AVX2 and FMA, and AVX-512F, where the building x86-64 CPU has them (the library is built for the machine
    that installs it, from source); none elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    if not {"avx2", "fma"} <= set(flags):
        return []
    return ["-mavx2", "-mfma", *(["-mavx512f"] if "avx512f" in flags else [])]


setup(
    ext_modules=[
        Extension(
            # Loaded with ctypes (axcore_cpu.native), never imported as a Python module.
            "axcore_cpu._kernels",
            sources=["csrc/sgemm.cc", "csrc/rows_dot.cc", "csrc/paged_decode.cc"],
            include_dirs=[os.path.join(os.path.dirname(jaxlib.__file__), "include")],
            language="c++",
            # -ffast-math: reassociated sums and vector exp, so the attention's loops vectorize (results
            # within float rounding; its inputs are finite).
            extra_compile_args=["-std=c++17", "-O3", "-ffast-math", *vector_flags(), "-Wno-attributes",
                                "-Wno-return-type"],
        )
    ]
)
