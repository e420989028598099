"""axcore-cpu's native library, loaded on first use: its XLA FFI handlers registered with JAX, the BLAS wired in.

`load()` is idempotent and thread-safe. It opens the library this package compiled at
install time (`csrc/*.cc`, next to this file as `_kernels*.so`), opens OpenBLAS
from the scipy-openblas32 wheel, hands the handlers OpenBLAS's `cblas_sgemm`, and
registers the FFI targets for the CPU platform. Nothing happens at import.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import math
import threading
from pathlib import Path

import jax

from axcore.errors import AxcoreError
from axcore.kernels import Problem, Support

# The XLA FFI target of the sgemm handler (`y = x . w`, float32).
SGEMM_TARGET = "axcore_cpu_sgemm"
# The XLA FFI target of the few-rows product handler (`y = x . w`, float32, no BLAS).
ROWS_DOT_TARGET = "axcore_cpu_rows_dot"
# The XLA FFI target of the paged decode attention handler.
PAGED_DECODE_TARGET = "axcore_cpu_paged_decode"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class NativeLibraryError(AxcoreError, RuntimeError):
    """The compiled library or OpenBLAS is missing; says how to reinstall."""


def library_path() -> Path:
    """The compiled library's file (`_kernels` with this interpreter's extension suffix)."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.exists():
            return path
    raise NativeLibraryError(
        f"axcore-cpu: no compiled library _kernels*.so in {here}; the package was not built (a source checkout "
        "on sys.path?). Install it with `pip install ./axcore_cpu` (needs a C++17 compiler)."
    )


def _openblas() -> ctypes.CDLL:
    try:
        import scipy_openblas32
    except ImportError as error:
        raise NativeLibraryError(f"axcore-cpu needs the scipy-openblas32 package ({error}); `pip install scipy-openblas32`.") from error
    path = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    return ctypes.CDLL(str(path))


def load() -> ctypes.CDLL:
    """The native library, loaded and its FFI targets registered (once per process)."""
    with _lock:
        if "kernels" in _loaded:
            return _loaded["kernels"]
        kernels = ctypes.CDLL(str(library_path()))
        blas = _openblas()
        # One BLAS thread: the handler splits each product over XLA's own intra-op threads instead.
        blas.scipy_openblas_set_num_threads(1)
        kernels.axcore_cpu_set_sgemm(ctypes.cast(blas.scipy_cblas_sgemm, ctypes.c_void_p))
        jax.ffi.register_ffi_target(SGEMM_TARGET, jax.ffi.pycapsule(kernels.AxcoreCpuSgemm), platform="cpu")
        jax.ffi.register_ffi_target(ROWS_DOT_TARGET, jax.ffi.pycapsule(kernels.AxcoreCpuRowsDot), platform="cpu")
        jax.ffi.register_ffi_target(
            PAGED_DECODE_TARGET, jax.ffi.pycapsule(kernels.AxcoreCpuPagedDecode), platform="cpu"
        )
        _loaded["kernels"], _loaded["blas"] = kernels, blas
        return kernels


def ffi_call_unsupported(problem: Problem) -> Support | None:
    """Why an FFI call of this library cannot serve `problem` (not the cpu platform, or a mesh of more than one
    device: a custom call has no sharding rule), or None if it can."""
    if problem.platform != "cpu":
        return Support(False, f"only for the cpu platform, not {problem.platform}")
    if problem.mesh is not None and math.prod(problem.mesh.shape.values()) > 1:
        return Support(False, "a mesh of more than one device (the custom call has no sharding rule)")
    return None
