"""Plugins installed as distributions: loading by name from the `axcore` entry-point group.

A temporary `*.dist-info` on sys.path simulates `pip install`: importlib.metadata
finds its entry points exactly as it finds those of installed packages.
"""

import sys
import textwrap

import jax.numpy as jnp
import pytest

import axcore
from axcore.errors import PluginLoadError, PluginVersionError, UnknownPluginError
from axcore.experiment.builtins import create_plugin_manager
from axcore.plugin.loading import DISABLE_AUTOLOAD_ENV

MODULES = ("axtest_good", "axtest_broken", "axtest_unneeded")


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Installs distribution axcore-testplug 1.2.0 with entry points good/broken/unneeded."""
    dist_info = tmp_path / "axcore_testplug-1.2.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: axcore-testplug\nVersion: 1.2.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[axcore]\ngood = axtest_good\nbroken = axtest_broken\nunneeded = axtest_unneeded\n"
    )
    (tmp_path / "axtest_good.py").write_text(textwrap.dedent("""
        import axcore
        from axcore.layers import Linear

        class Doubling(Linear):
            def forward(self, x):
                return 2 * super().forward(x)

        @axcore.hookimpl
        def axcore_register_layers(register):
            register("doubling_linear", Doubling)
    """))
    (tmp_path / "axtest_broken.py").write_text("import a_module_that_does_not_exist\n")
    (tmp_path / "axtest_unneeded.py").write_text("raise RuntimeError('must never be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in MODULES:
        sys.modules.pop(name, None)


def test_loads_plugin_by_name(installed):
    pm = create_plugin_manager(["good"])
    info = pm.plugins[-1]
    assert (info.name, info.distribution, info.version, info.source) == ("good", "axcore-testplug", "1.2.0", "entry-point")
    layer_cls = pm.registries.layers["doubling_linear"]
    assert layer_cls.__name__ == "Doubling"
    layer = layer_cls.default_config().set(input_dim=2, output_dim=2, bias=False).instantiate(name="l", registries=pm.registries)
    params = {"weight": jnp.eye(2)}
    out, _ = axcore.functional(layer, params, (jnp.array([1.0, 3.0]),), None, False)
    assert out.tolist() == [2.0, 6.0]


def test_entry_points_not_asked_for_are_not_imported(installed):
    create_plugin_manager(["good"])
    assert "axtest_unneeded" not in sys.modules and "axtest_broken" not in sys.modules


def test_version_specifier(installed):
    create_plugin_manager(["good>=1.0,<2"])
    with pytest.raises(PluginVersionError, match=r"'good' >=2\.0.*axcore-testplug 1\.2\.0"):
        create_plugin_manager(["good>=2.0"])


def test_unknown_name_lists_installed(installed):
    with pytest.raises(UnknownPluginError, match=r"'godo'.*did you mean 'good'.*installed plugins: ") as info:
        create_plugin_manager(["godo"])
    listed = str(info.value).split("installed plugins: ")[1].split(".")[0].split(", ")
    assert {"broken", "good", "unneeded"} <= set(listed) and listed == sorted(listed)


def test_broken_plugin_names_its_distribution_and_the_way_out(installed):
    with pytest.raises(PluginLoadError, match=r"'broken' \(distribution axcore-testplug\) failed to import.*ModuleNotFoundError.*pip uninstall axcore-testplug") as info:
        create_plugin_manager(["broken"])
    assert DISABLE_AUTOLOAD_ENV in str(info.value)


def test_platform_plugin_autoloads_unless_disabled(installed, monkeypatch):
    pm = create_plugin_manager([], platform="good")
    assert "doubling_linear" in pm.registries.layers
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    pm = create_plugin_manager([], platform="good")
    assert "doubling_linear" not in pm.registries.layers
    # An explicitly named plugin still loads with autoloading disabled.
    assert "doubling_linear" in create_plugin_manager(["good"], platform="good").registries.layers
