"""Each feature plugin carries its own tests: `python -m pytest plugins/<name>` (from the repository
root) runs them, and the README's test command (the root `testpaths`) collects each exactly once."""

import collections
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
# The hf plugin's tests, and the qwen and gemma families', are in tests/plugins/ (test_hf_*.py, test_<family>_convert.py).
OWN_TESTS = ("alibi", "dpo", "lora", "moe", "remat", "rope", "swiglu", "tokenizers")


def _collected(*paths):
    """Node ids `pytest --collect-only` finds for `paths`, run from the repository root as a user would."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_pytest_on_a_plugin_directory_runs_that_plugins_tests_and_the_suite_collects_them_once():
    by_plugin = collections.Counter()
    for node in _collected(*(f"plugins/{name}" for name in OWN_TESTS)):
        parts = node.split("/")
        assert parts[0] == "plugins" and parts[2] == "tests", node
        by_plugin[parts[1]] += 1
    assert set(by_plugin) == set(OWN_TESTS), by_plugin
    everything = collections.Counter(_collected())  # The README's command: the root's testpaths.
    assert not [node for node, n in everything.items() if n > 1]
    in_suite = collections.Counter(node.split("/")[1] for node in everything if node.startswith("plugins/"))
    assert in_suite == by_plugin
