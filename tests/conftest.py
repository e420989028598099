"""Shared fixtures."""

import pytest

from axcore.plugins import builtin_registries


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
        help="rewrite tests/golden/*.txt from the current resolved configs",
    )
