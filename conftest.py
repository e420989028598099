"""Shared fixtures, and one persistent JAX compilation cache for the whole test session.

At the repository root, so it applies to every test folder (`tests/`, `plugins/*/tests`,
`axcore_gpu|tpu|neuron/tests`, `examples/*/tests`) and `python -m pytest plugins/rope`
gets it too. It puts nothing on `sys.path`: the helpers plugins' tests share are in
`axcore.testing`; axcore's own test-only helpers are in `tests/helpers/` (pytest's `pythonpath`).

Many tests start `axcore train` in subprocesses on the same tiny model; sharing XLA's
compiled programs through a cache directory (removed at the end of the session)
saves their repeated compiles. The cache holds the same programs, so no result
depends on it; a cache directory the caller set is kept as it is. Compiles are also made
cheaper with XLA flags (below).
"""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="axcore-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    # Only compiles that take a while are worth a disk round trip.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# The suite compiles thousands of tiny programs whose run time is negligible next to their
# compile time: XLA's CPU backend without its LLVM optimizations compiles them about twice
# as fast (the same HLO, buffers and donation; only the machine code is less tuned). A caller
# who set an optimization level keeps it; tests that start subprocesses keep these flags by
# extending XLA_FLAGS (`axcore.testing.host_devices_env`) rather than replacing it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# The developer tools (devtools/, the axcore-devtools distribution, not in the runtime wheel): `axcore loc` and the
# docs' generators, tested here without installing them.
_DEVTOOLS = str(pathlib.Path(__file__).resolve().parent / "devtools")
if _DEVTOOLS not in sys.path:
    sys.path.insert(0, _DEVTOOLS)

from axcore.experiment.builtins import builtin_registries  # noqa: E402


@pytest.fixture(scope="session")
def registries():
    """Registries of a plugin manager with only the built-in plugins."""
    return builtin_registries()


def pytest_configure(config):
    import jax

    if jax.default_backend() == "gpu":
        # The numerical tests compare float32 results with NumPy at ~1e-5; GPUs run float32
        # matmuls as TF32 by default, which is 1e-3 close.
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens", action="store_true", default=False,
        help="rewrite the golden files (tests/golden/*.txt, axcore_*/tests/golden/*.txt) from the current outputs",
    )
