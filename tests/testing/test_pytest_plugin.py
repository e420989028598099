"""axcore's pytest plugin: registered as a pytest11 entry point, cheap to load, fixtures for authors."""

import importlib.metadata
import subprocess
import sys

pytest_plugins = ["pytester"]


def test_registered_and_imports_no_jax():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert eps.get("axcore") == "axcore.testing.pytest_plugin"
    code = "import sys, axcore.testing, axcore.testing.pytest_plugin; print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_fixtures_with_a_plugin_object_and_without_a_plugin(pytester):
    pytester.makepyfile(
        """
        import pytest
        import axcore

        class Plugin:
            @axcore.hookimpl
            def axcore_register_config_modifiers(self, register):
                register("noop", lambda: (lambda config: config))

        @pytest.fixture
        def axcore_plugin():
            return Plugin()

        @pytest.fixture
        def axcore_plugin_name():
            return "obj"

        def test_manager(axcore_plugin_manager, axcore_registries, axcore_tiny_experiment):
            assert [p.name for p in axcore_plugin_manager.plugins if p.source == "object"] == ["obj"]
            assert "noop" in axcore_registries.config_modifiers
            assert axcore_tiny_experiment().config.plugins == ["obj"]
        """
    )
    pytester.makepyfile(test_unset="def test_unset(axcore_plugin_name):\n    pass\n")
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*set `axcore_plugin = NAME`*"])
