"""The core's layer contracts (`[tool.importlinter]` in pyproject.toml), checked by import-linter.

The contracts say which of axcore's modules may import which: lower layers never import
higher ones (between packages, and inside the packages with layers of their own), and
no packages or modules import each other in a cycle, with no exceptions listed. A deliberately
upward import in a copy of the package must break them, so the passing run cannot be
vacuous.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _lint_imports(cwd: pathlib.Path, package_parent: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package_parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
         "--no-cache"], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_the_layer_contracts_hold():
    proc = _lint_imports(ROOT, ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "KEPT" in proc.stdout


@pytest.mark.parametrize(
    "lower, upper",
    [
        ("errors", "axcore.cli"),  # Across the package layers.
        ("plugin/entry_points", "axcore.plugin.manager"),  # Inside a package with layers of its own.
    ],
)
def test_an_upward_import_breaks_them(tmp_path, lower, upper):
    shutil.copytree(ROOT / "axcore", tmp_path / "axcore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "axcore" / f"{lower}.py"
    module.write_text(module.read_text() + f"\n\ndef _late():\n    import {upper}  # An upward import.\n")
    proc = _lint_imports(tmp_path, tmp_path)
    assert proc.returncode != 0, proc.stdout[-4000:]
    importer = "axcore." + lower.replace("/", ".")
    assert f"{importer} is not allowed to import {upper}" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.parametrize(
    "importer, contract",
    [
        # Inference sits above the trainer, so only its own contract refuses `axcore.trainer` (it uses the placement).
        ("inference/run_loading", "axcore.inference is not allowed to import axcore.trainer"),
        # The placement sits below the train step that owns one.
        ("placement/placement", "axcore.placement is not allowed to import axcore.trainer"),
    ],
)
def test_importing_the_train_step_breaks_them(tmp_path, importer, contract):
    shutil.copytree(ROOT / "axcore", tmp_path / "axcore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "axcore" / f"{importer}.py"
    module.write_text(module.read_text() + "\n\ndef _late():\n    import axcore.trainer.step  # A training step.\n")
    proc = _lint_imports(tmp_path, tmp_path)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert contract in proc.stdout, proc.stdout[-4000:]
    assert f"axcore.{importer.replace('/', '.')} -> axcore.trainer.step" in proc.stdout, proc.stdout[-4000:]
