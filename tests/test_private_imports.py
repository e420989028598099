"""No Python source imports another package's private names (issue 35: one public surface).

A name or module whose name starts with one underscore is private to the package that
holds it. A package is one of axcore's subpackages or top-level modules (`axcore.cli`,
`axcore.plugin`, `axcore.module`, ...), a plugin distribution (`axcore_hf`,
`axcore_gpu`, ...), `benchmarks`, or the tests. A private module directly under a
package (`axcore.checkpoint._verify`) is private to that package and
everything inside it. The check reads every source under axcore/, plugins/, axcore_*/,
benchmarks/ and tests/ with `ast`: `from X import _name`, `from X._mod import name`,
`import X._mod` and `alias._name` (alias an imported project module) are offences when
X's package is not the importer's own. Third-party modules are out of its scope.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _source_roots() -> dict[str, pathlib.Path]:
    """Top-level import name -> its folder, for the project's own packages."""
    roots = {"axcore": ROOT / "axcore", "benchmarks": ROOT / "benchmarks"}
    folders = ["axcore_*/axcore_*", "plugins/*/axcore_*", "examples/*/axcore_*", "devtools/axcore_*"]
    for folder in (path for pattern in folders for path in ROOT.glob(pattern)):
        if (folder / "__init__.py").exists():
            roots[folder.name] = folder
    return roots


ROOTS = _source_roots()
TEST_MODULES = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {
    p.stem for p in ROOT.glob("plugins/*/tests/*.py")
}


def _package_of_module(module: str) -> str | None:
    """The package owning `module` ("axcore.cli" for axcore.cli.generate); None if third-party."""
    parts = module.split(".")
    if parts[0] == "axcore":
        return ".".join(parts[:2])
    if parts[0] in ROOTS:
        return parts[0]
    if parts[0] in TEST_MODULES:
        return "tests"
    return None


def _package_of_file(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "axcore":
        return "axcore." + (rel[1][:-3] if rel[1].endswith(".py") else rel[1]) if len(rel) > 1 else "axcore"
    for name, folder in ROOTS.items():
        if folder in path.parents:
            return name
    if ROOT / "tests" / "core" in path.parents:
        return "axcore"  # The tests of axcore's top-level modules (module, params ...).
    return "tests"  # tests/, plugins/*/tests, conftest files.


def _owner(module: str, name: str | None) -> str | None:
    """The package a private reference `module[.name]` belongs to; None if nothing in it is private."""
    parts = module.split(".") + ([name] if name else [])
    for i, part in enumerate(parts):
        if _private(part) and i > 0:
            outer = ".".join(parts[:i])
            # A private module directly under a package belongs to that package (the root's
            # `axcore._x`, none today, to all of axcore); a private name in a module to the module's package.
            return outer if outer == "axcore" else _package_of_module(outer)
    return None


def _is_project_module(dotted: str) -> bool:
    parts = dotted.split(".")
    folder = ROOTS.get(parts[0])
    if folder is None:
        return False
    path = folder.joinpath(*parts[1:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _offences(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    mine = _package_of_file(path)
    aliases: dict[str, str] = {}  # Local name -> imported project module.
    found = []

    def check(module: str, name: str | None, line: int) -> None:
        owner = _owner(module, name)
        if owner is not None and mine != owner and not mine.startswith(owner + "."):
            found.append(f"{path.relative_to(ROOT)}:{line}: {module}{'.' + name if name else ''} (private to {owner})")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _package_of_module(node.module) is None:
                continue
            for alias in node.names:
                check(node.module, alias.name, node.lineno)
                if _is_project_module(f"{node.module}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _package_of_module(alias.name) is not None:
                    check(alias.name, None, node.lineno)
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or alias.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                module = ".".join([aliases[value.id], *chain])
                if _is_project_module(module):
                    check(module, node.attr, node.lineno)
    return found


def _sources() -> list[pathlib.Path]:
    folders = [ROOT / "axcore", ROOT / "plugins", ROOT / "benchmarks", ROOT / "tests", *ROOT.glob("axcore_*")]
    return sorted(p for folder in folders for p in folder.rglob("*.py") if not {".venv", "build"} & set(p.parts))


def test_no_source_imports_another_packages_private_names():
    offences = [o for path in _sources() for o in _offences(path)]
    assert not offences, "private names imported across packages:\n" + "\n".join(offences)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from axcore.cli.generate import _chat_template\n", "axcore.cli.generate._chat_template"),
        ("from axcore.checkpoint import _verify\n", "axcore.checkpoint._verify"),
        ("from axcore.checkpoint._verify import verify\n", "axcore.checkpoint._verify"),
        ("import axcore.cli.generate as g\ng._chat_template()\n", "axcore.cli.generate._chat_template"),
        ("import axcore.cli.generate\naxcore.cli.generate._chat_template()\n", "axcore.cli.generate._chat_template"),
    ],
)
def test_the_check_finds_an_offence(tmp_path, monkeypatch, source, expected):
    """The same check over a planted test file reports it (so the passing run is not vacuous)."""
    planted = ROOT / "tests" / "_planted_private_import.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, encoding=None: source)
    offences = _offences(planted)
    assert len(offences) == 1 and expected in offences[0], offences


@pytest.mark.parametrize(
    "relative, source",
    [
        ("axcore/plugin/loading.py", "from axcore.plugin.entry_points import _dist_of\n"),  # Same package.
        ("tests/test_x.py", "from numpy_ref import _helper\nimport jax._src\n"),  # Tests' own; third-party.
    ],
)
def test_the_check_allows_a_package_its_own_private_names(monkeypatch, relative, source):
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, encoding=None: source)
    assert _offences(ROOT / relative) == []
