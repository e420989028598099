"""Each package states its public names once: the lazy maps of `axcore.plugin`, `axcore.experiment` and `axcore.config`
are read from their modules' `__all__` (axcore/config/lazy.py), never restated."""

import importlib

import pytest


@pytest.mark.parametrize(
    "package, modules",
    [
        ("axcore.plugin", ["loading"]),
        ("axcore.experiment", ["loading", "builtins"]),
        ("axcore.config", ["base", "constraints", "serialize", "traversal"]),
    ],
)
def test_a_package_exports_exactly_its_modules_public_names(package, modules):
    pkg = importlib.import_module(package)
    imported = [importlib.import_module(f"{package}.{m}") for m in modules]
    # The imported modules' own __all__ (run, not parsed) is the independent reference.
    assert pkg.__all__ == sorted(name for module in imported for name in module.__all__)
    for module in imported:
        for name in module.__all__:
            assert getattr(pkg, name) is getattr(module, name), f"{package}.{name}"

