"""A throwaway virtual environment for tests that `pip install` packages (never into this environment).

`make_venv(directory)` creates a venv without pip that sees this environment's packages
(axcore, JAX, pytest) through a `.pth` file, so what a test installs into it leaves this
environment's entry points alone; `install_editable(python, paths)` installs packages
in it as a contributor does (`pip install -e`, no dependencies, no build isolation).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

TIMEOUT_S = 300


def run(args: Sequence[str], cwd: str | os.PathLike | None = None, env: dict | None = None) -> str:
    """Runs `args`; its stdout; AssertionError with its output unless it exits 0."""
    result = subprocess.run(list(map(str, args)), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def make_venv(directory: Path) -> str:
    """A venv at `directory` seeing this environment's site-packages; -> its python."""
    run([sys.executable, "-m", "venv", "--without-pip", str(directory)])
    python = str(directory / "bin" / "python")
    site_packages = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    parent = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site_packages, "_axcore_parent_env.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({parent!r})\n")
    return python


def install_editable(python: str, paths: Sequence[Path]) -> None:
    """`pip install -e` each of `paths` into `python`'s venv, without dependencies or build isolation."""
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check"]
    # Editable installs without build isolation need a setuptools with bdist_wheel (>= 70.1): the test
    # extra installs one here; only an older environment makes the throwaway venv fetch its own.
    import setuptools

    if tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (70, 1):
        run([*pip, "setuptools>=70.1"])
    run([*pip, "--no-deps", "--no-build-isolation", *(a for p in paths for a in ("-e", str(p)))])
