"""Each feature plugin's own tests (`plugins/<name>/tests/`) use axcore's shared test setup.

`python -m pytest plugins/rope` (from the repository root) loads this file, not
`tests/conftest.py`, which pytest applies to `tests/` only. So this file gives the
plugin tests what that one gives axcore's tests, taken from that file itself, never
a copy: `tests/` on `sys.path` (the helpers `tiny`, `numpy_ref`), the session's JAX
compilation cache (set when `tests/conftest.py` is executed), the `registries` fixture and
full float32 matmuls on a GPU (its `pytest_configure`). When the whole suite runs,
both files are loaded; the second execution of `tests/conftest.py` finds the cache
variable set and leaves it, and running `pytest_configure` twice changes nothing.
"""

import importlib.util
import pathlib
import sys

_TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))


def _load_shared_conftest():
    """`tests/conftest.py` as a module of another name (pytest owns the name `conftest`)."""
    spec = importlib.util.spec_from_file_location("axcore_tests_conftest", _TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _load_shared_conftest()
registries = _shared.registries
pytest_configure = _shared.pytest_configure
