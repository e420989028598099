"""The plugin under test for axcore's fixtures.

`axcore_plugin = "sinusoidal"` in this package's pyproject.toml is enough when pytest
runs here; overriding the fixture also works when axcore's own test run (from the
repository root, another pyproject.toml) collects these tests.
"""

import pytest


@pytest.fixture
def axcore_plugin_name():
    return "sinusoidal"
