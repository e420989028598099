"""Meta-tests: every hookspec has a test that implements it, and axcore really calls each one.

`tests/plugin/test_hookspecs.py` checks that tests/ implements every hook; this file also
scans the plugins' and the example plugin's tests, names the files, and checks that a
plugin implementing every hook sees each of them called when an experiment is
resolved (the path `axcore train` takes).
"""

import inspect
import pathlib
import re
import types

import pytest

import axcore
from axcore.plugin import hookspecs

from axcore_devtools.hook_reference import hook_names

ROOT = pathlib.Path(__file__).parents[2]
TEST_DIRS = [
    ROOT / "tests",
    *sorted(ROOT.glob("plugins/*/tests")),
    *sorted(ROOT.glob("axcore_*/tests")),
    *sorted(ROOT.glob("examples/*/tests")),
]


def _test_files() -> list[pathlib.Path]:
    return [path for directory in TEST_DIRS for path in directory.rglob("*.py") if path.name != pathlib.Path(__file__).name]


def test_every_hookspec_is_implemented_by_some_test():
    files = {path: path.read_text() for path in _test_files()}
    untested = [hook for hook in hook_names() if not any(re.search(rf"\bdef {hook}\(", text) for text in files.values())]
    assert not untested, f"hooks no test implements (add one to tests/plugin/test_hook_coverage.py): {', '.join(untested)}"


def _recording_plugin(calls: list[str]) -> types.ModuleType:
    """A plugin module implementing every hookspec with its full signature; each records its call."""
    source = []
    for hook in hook_names():
        arguments = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
        result = "config" if hook == "axcore_transform_config" else "None"
        source.append(f"@axcore.hookimpl\ndef {hook}({arguments}):\n    calls.append({hook!r})\n    return {result}\n")
    plugin = types.ModuleType("recording_plugin")
    plugin.__dict__.update(axcore=axcore, calls=calls)
    exec("\n".join(source), plugin.__dict__)  # Generated from the hookspecs above.
    return plugin


def test_resolving_an_experiment_calls_every_hook():
    calls: list[str] = []
    experiment = axcore.load_experiment(
        "default", ["plugins=[recording]", "model.num_layers=1", "mesh.instance_type=cpu-1"],
        objects={"recording": _recording_plugin(calls)},
    )
    # Asked only of installed hardware plugins (gpu, tpu, neuron) before any manager exists
    # (tests/platform/test_xla_flags.py); call it through pluggy like axcore does.
    assert None not in experiment.plugin_manager.pm.hook.axcore_probe_instance_type()  # pluggy drops Nones.
    missing = [hook for hook in hook_names() if hook not in calls]
    assert not missing, f"hooks never called while resolving an experiment: {', '.join(missing)}"
    assert calls.count("axcore_transform_config") == 1 and calls.count("axcore_settings_config") == 1


@pytest.mark.parametrize("hook", hook_names())
def test_hookspec_arguments_are_named_in_the_spec_docstring(hook):
    spec = getattr(hookspecs, hook)
    doc = inspect.getdoc(spec)
    for argument in inspect.signature(spec).parameters:
        assert f"{argument}:" in doc, f"{hook}: the docstring does not describe argument {argument!r}"
