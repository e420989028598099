"""Tests mirror the code: `tests/<package>/` for each package of axcore, and each plugin (the feature
plugins in plugins/, the hardware packages axcore_gpu|tpu|neuron) carries its own `tests/`, which
`python -m pytest plugins/<name>` (from the repository root) runs from the plugin alone; the README's
test command (the root `testpaths`) collects each test exactly once."""

import ast
import collections
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# The only modules flat in tests/: checks across the whole repository, not of one package.
CROSS_CUTTING = {
    "test_docs.py",  # docs/ against the code
    "test_lint.py",  # ruff over every Python file
    "test_import_contracts.py",  # import-linter's layer contracts
    "test_three_platforms.py",  # one experiment on the gpu, tpu and neuron plugins together
    "test_hardware_install.py",  # the three hardware packages installed beside axcore
    "test_security.py",  # promises across config, checkpoint and CLI (docs/reliability.md)
    "test_plugin_tests_layout.py",  # this convention
    "test_private_imports.py",  # no source imports another package's private names
    "test_public_names.py",  # each package states its public names once
}
# Folders of tests/ that are not a package of axcore: its top-level modules (module, params, ...),
# the benchmarks/ scripts, the developer tools (devtools/, axcore-devtools), axcore's test-only helpers (on sys.path through pytest's `pythonpath`), golden files.
NOT_PACKAGES = {"core", "benchmarks", "helpers", "golden", "devtools"}
# Packages without their own folder: the built-in experiment YAML files, checked by tests/experiment and tests/cli.
UNTESTED_ALONE = {"experiments"}
PLUGIN_DIRS = sorted(
    [path.parent for path in REPO.glob("plugins/*/pyproject.toml")]
    + [REPO / name for name in ("axcore_gpu", "axcore_cpu", "axcore_tpu", "axcore_neuron")]
)


def _packages() -> set[str]:
    return {path.parent.name for path in (REPO / "axcore").glob("*/__init__.py")}


def test_only_cross_cutting_modules_are_flat_in_tests():
    flat = {path.name for path in TESTS.glob("*.py")}
    assert flat == CROSS_CUTTING, f"move {sorted(flat - CROSS_CUTTING)} to tests/<package>/"


def test_each_package_of_axcore_has_its_folder_of_tests_and_each_folder_is_a_package():
    assert {"cli", "config", "trainer"} <= _packages()  # The glob sees the packages.
    folders = {path.name for path in TESTS.iterdir() if path.is_dir() and path.name != "__pycache__"}
    missing = _packages() - UNTESTED_ALONE - folders
    assert not missing, f"no tests/<package>/ for {sorted(missing)}"
    strays = folders - _packages() - NOT_PACKAGES
    assert not strays, f"tests/ folders named after no package of axcore: {sorted(strays)}"
    empty = [name for name in folders - {"golden", "helpers"} if not list((TESTS / name).glob("test_*.py"))]
    assert not empty, f"folders without a test module: {sorted(empty)}"


def test_every_plugin_carries_its_own_tests():
    assert len(PLUGIN_DIRS) >= 15, PLUGIN_DIRS  # 12 feature plugins and 3 hardware packages today.
    without = [path.name for path in PLUGIN_DIRS if not list(path.glob("tests/test_*.py"))]
    assert not without, f"plugins without tests/test_*.py: {without}"


def test_plugin_tests_import_nothing_from_axcores_tests():
    """A plugin's tests share helpers through `axcore.testing` (or their own folder), never `tests/`."""
    ours = {path.stem for path in TESTS.rglob("*.py")}
    found = []
    for directory in PLUGIN_DIRS:
        own = {path.stem for path in directory.glob("tests/*.py")}
        for path in directory.glob("tests/*.py"):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ours - own]
    assert not found, found


def _collected(*paths):
    """Node ids `pytest --collect-only` finds for `paths`, run from the repository root as a user would."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_pytest_on_a_plugin_directory_runs_that_plugins_tests_and_the_suite_collects_them_once():
    names = [path.relative_to(REPO).as_posix() for path in PLUGIN_DIRS]
    by_plugin = collections.Counter()
    for node in _collected(*names):
        directory = node.split("/tests/")[0]
        assert directory in names and node.startswith(f"{directory}/tests/"), node
        by_plugin[directory] += 1
    assert set(by_plugin) == set(names), by_plugin
    everything = collections.Counter(_collected())  # The README's command: the root's testpaths.
    assert not [node for node, n in everything.items() if n > 1]
    in_suite = collections.Counter(node.split("/tests/")[0] for node in everything if not node.startswith("tests/"))
    in_suite.pop("examples/axcore-sinusoidal", None)
    assert in_suite == by_plugin
