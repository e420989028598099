"""ruff runs as part of the suite (CI runs only pytest): the repository's Python is clean under the rule set
configured in `pyproject.toml` (`[tool.ruff]`: imports, unused and undefined names, bugbear).

Fix locally with `ruff check --fix` (then review the diff); `ruff` comes with the `test` extra.
"""

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# Every folder of Python the repository ships or runs.
LINTED = ["axcore", "devtools", "axcore_gpu", "axcore_cpu", "axcore_tpu", "axcore_neuron", "plugins", "examples", "benchmarks", "tests"]


def _ruff(*args: str, cwd: pathlib.Path = REPO) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed; it is part of the test extra: pip install -e '.[test]'")
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_repository_is_clean_under_ruff():
    result = _ruff(*LINTED)
    assert result.returncode == 0, f"ruff check (fix with `ruff check --fix`):\n{result.stdout}{result.stderr}"


def test_the_configured_rules_catch_what_they_are_for(tmp_path):
    # One violation per selected family, in a file ruff reads with the repository's configuration: the
    # clean run above means something only if these are reported.
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""\
        import sys
        import os


        def append(item, items=[]):
            items.append(item)
            return undefined_name
        """))
    result = _ruff("--config", str(REPO / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    reported = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("bad.py:")}
    # Import order (I001), unused imports (F401), undefined names (F821), bugbear's mutable default (B006).
    assert reported == {"I001", "F401", "F821", "B006"}, result.stdout
