"""Each package states its public names once: the lazy maps of `axcore.plugin` and `axcore.experiment`
are read from their modules' `__all__` (axcore/_lazy.py), never restated."""

import importlib

import pytest

from axcore._lazy import declared_all


@pytest.mark.parametrize(
    "package, modules",
    [("axcore.plugin", ["loading"]), ("axcore.experiment", ["loading", "builtins"])],
)
def test_a_package_exports_exactly_its_modules_public_names(package, modules):
    pkg = importlib.import_module(package)
    imported = [importlib.import_module(f"{package}.{m}") for m in modules]
    # The imported modules' own __all__ (run, not parsed) is the independent reference.
    assert pkg.__all__ == sorted(name for module in imported for name in module.__all__)
    for module in imported:
        for name in module.__all__:
            assert getattr(pkg, name) is getattr(module, name), f"{package}.{name}"


def test_declared_all_refuses_a_module_without_a_literal_list(tmp_path):
    source = tmp_path / "computed.py"
    source.write_text("names = ['a']\n__all__ = list(names)\n")
    with pytest.raises(ValueError, match="literal"):
        declared_all(str(source))
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="states no literal __all__"):
        declared_all(str(tmp_path / "none.py"))
