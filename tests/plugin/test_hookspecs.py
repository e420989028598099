"""Meta-tests: every hook is documented and exercised by a test."""

import ast
import inspect
import pathlib

import pytest

from axcore.plugin import hookspecs

ROOT = pathlib.Path(__file__).parents[2]
# Every test folder: axcore's, the feature plugins', the hardware packages' and the examples'.
TEST_DIRS = [ROOT / "tests", *ROOT.glob("plugins/*/tests"), *ROOT.glob("axcore_*/tests"), *ROOT.glob("examples/*/tests")]
HOOKS = [name for name, fn in vars(hookspecs).items() if name.startswith("axcore_") and inspect.isfunction(fn)]


def test_every_axcore_function_of_hookspecs_is_a_hook_the_manager_knows():
    import axcore

    known = {name for name in vars(axcore.create_plugin_manager().pm.hook) if name.startswith("axcore_")}
    assert HOOKS and set(HOOKS) <= known


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert doc and len(doc.split()) > 30, hook
    assert "Returns" in doc and "Called" in doc, f"{hook}: say the return contract and when it is called"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test_implementing_it(hook):
    implemented = set()
    for path in (path for directory in TEST_DIRS for path in directory.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("axcore_"):
                implemented.add(node.name)
    assert hook in implemented, f"no test implements {hook}"


def test_hookspec_module_holds_only_specs():
    names = {n for module in hookspecs.PHASES for n, f in vars(module).items()
             if inspect.isfunction(f) and f.__module__ == module.__name__}
    assert names == set(HOOKS)
