"""axcore's top level holds only the modules issue 35 allows; everything else lives in a package."""

import pathlib

import axcore

# The allowed top-level modules of axcore/ (fewer is fine).
ALLOWED = {"__init__", "errors", "markers", "module", "params", "registry"}


def test_axcore_has_no_top_level_module_besides_the_allowed_ones():
    folder = pathlib.Path(axcore.__file__).parent
    found = {path.stem for path in folder.glob("*.py")}
    assert {"__init__", "errors"} <= found, found  # The listing sees the package's own files.
    assert found <= ALLOWED, f"move {sorted(found - ALLOWED)} into a package of axcore/"
