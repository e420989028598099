"""Shared fixtures."""

import pytest

from axcore.plugins import builtin_registries


@pytest.fixture(scope="session")
def registries():
    """Registries of a plugin manager with only the built-in plugins."""
    return builtin_registries()


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens", action="store_true", default=False,
        help="rewrite tests/golden/*.txt from the current resolved configs",
    )
