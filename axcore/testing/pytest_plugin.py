"""axcore's pytest plugin for plugin authors (entry point `pytest11: axcore`).

Fixtures (the plugin under test is named by the ini option `axcore_plugin`, e.g.
`[tool.pytest.ini_options] axcore_plugin = "my_feature"`, or by overriding the
`axcore_plugin_name` fixture; override `axcore_plugin` to test an object that is not
installed):

- `axcore_plugin_name`: the entry-point name of the plugin under test.
- `axcore_plugin`: the plugin object to register, or None to load the installed entry point.
- `axcore_plugin_manager`: a plugin manager with the built-ins and just that plugin.
- `axcore_registries`: that manager's registries.
- `axcore_tiny_experiment`: `load(overrides=(), *, source="default", plugins=None)` -> a tiny
  `Experiment` (TINY_OVERRIDES) with `plugins: [<the plugin>]` unless `plugins` is given.
- `axcore_train_steps`: `run(experiment, steps=3)` -> the losses of a few SGD steps.

The conformance suites are in `axcore.testing` (`AttentionKernelConformance`, ...).
pytest loads this module in every session of anyone who installs axcore, so it
imports only pytest here; axcore's modules (and JAX) load when a fixture is used.
"""

from __future__ import annotations

import pytest

INI_OPTION = "axcore_plugin"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_OPTION, "entry-point name of the axcore plugin under test (axcore fixtures)", default="")


@pytest.fixture
def axcore_plugin_name(request: pytest.FixtureRequest) -> str:
    """The plugin under test: the ini option `axcore_plugin` (override this fixture to choose another)."""
    name = str(request.config.getini(INI_OPTION)).strip()
    if not name:
        pytest.fail(
            "The axcore fixtures need the plugin under test: set `axcore_plugin = NAME` in "
            "[tool.pytest.ini_options] or override the `axcore_plugin_name` fixture.",
            pytrace=False,
        )
    return name


@pytest.fixture
def axcore_plugin() -> object | None:
    """The plugin object to register under `axcore_plugin_name`; None = load the installed entry point."""
    return None


@pytest.fixture
def axcore_plugin_objects(axcore_plugin_name: str, axcore_plugin: object | None) -> dict:
    """`objects=` for `create_plugin_manager`/`load_experiment`: the plugin object, if one is given."""
    return {} if axcore_plugin is None else {axcore_plugin_name: axcore_plugin}


@pytest.fixture
def axcore_plugin_manager(axcore_plugin_name: str, axcore_plugin_objects: dict):
    """A plugin manager with the built-in plugins and just the plugin under test."""
    from axcore.experiment.builtins import create_plugin_manager

    return create_plugin_manager([axcore_plugin_name], objects=axcore_plugin_objects)


@pytest.fixture
def axcore_registries(axcore_plugin_manager):
    """The registries of `axcore_plugin_manager`."""
    return axcore_plugin_manager.registries


@pytest.fixture
def axcore_tiny_experiment(axcore_plugin_name: str, axcore_plugin_objects: dict):
    """`load(overrides=(), *, source="default", plugins=None)`: a tiny experiment with the plugin listed."""
    from axcore.testing.training import load_tiny_experiment

    def load(overrides=(), *, source="default", plugins=None):
        listed = [axcore_plugin_name] if plugins is None else list(plugins)
        return load_tiny_experiment(listed, overrides, source=source, objects=axcore_plugin_objects)

    return load


@pytest.fixture
def axcore_train_steps():
    """`run(experiment, steps=3, learning_rate=0.1)`: the losses of a few SGD steps (checked finite)."""
    from axcore.testing.training import train_steps

    return train_steps
