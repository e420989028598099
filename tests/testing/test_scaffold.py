"""`axcore new-plugin`: each kind, freshly generated, installs with pip and passes its own tests."""

import os
import re

import pytest

from axcore.cli import main
from axcore.cli.new_plugin import KINDS

from throwaway_venv import install_editable, make_venv, run


@pytest.mark.parametrize("name", ["1abc", "My-Plugin", "class", "a.b", ""])
def test_bad_names_are_one_line_errors(name, tmp_path, capsys):
    assert main(["new-plugin", name, "--directory", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lowercase Python identifier" in err
    assert not (tmp_path / "p").exists()


def test_an_existing_directory_is_refused(tmp_path, capsys):
    (tmp_path / "p").mkdir()
    assert main(["new-plugin", "ok", "--directory", str(tmp_path / "p")]) == 2
    assert "exists already" in capsys.readouterr().err
    assert os.listdir(tmp_path / "p") == []


@pytest.mark.slow
def test_generated_plugins_install_and_pass_their_tests(tmp_path):
    packages = []
    for kind in KINDS:
        directory = tmp_path / f"axcore-gen-{kind}"
        assert main(["new-plugin", f"gen_{kind}", "--kind", kind, "--directory", str(directory)]) == 0
        assert {p.name for p in directory.iterdir()} == {"pyproject.toml", "README.md", f"axcore_gen_{kind}", "tests"}
        packages.append(directory)
    python = make_venv(tmp_path / "venv")
    install_editable(python, packages)
    names = run([python, "-c", "import importlib.metadata as m; print(*sorted(e.name for e in m.entry_points(group='axcore')))"])
    assert {f"gen_{kind}" for kind in KINDS} <= set(names.split())
    for directory in packages:  # One session each: every package's pytest.ini_options name its plugin.
        out = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=directory)
        assert " passed" in out and "failed" not in out and "error" not in out, out


def test_a_feature_plugin_says_nothing_it_does_not_do(tmp_path):
    """The feature scaffold used to call every plugin a logit soft-cap and link a placeholder URL."""
    directory = tmp_path / "axcore-my-feature"
    assert main(["new-plugin", "my_feature", "--directory", str(directory)]) == 0
    texts = {p.relative_to(directory).as_posix(): p.read_text() for p in directory.rglob("*") if p.is_file()}
    assert set(texts) == {
        "pyproject.toml", "README.md", "axcore_my_feature/__init__.py", "axcore_my_feature/plugin.py",
        "tests/test_my_feature.py",
    }
    for path, text in texts.items():
        for word in ("soft-cap", "softcap", "soft cap", "logit", "github.com/", "://"):
            assert word not in text.lower(), f"{path} says {word!r}"
    # The one-line description is built from the name and is a TODO the README tells the author to fill.
    summary = "My feature: an axcore feature plugin (TODO: say what it does, in one line)."
    assert f'description = "{summary}"' in texts["pyproject.toml"]
    assert texts["README.md"].splitlines()[2] == summary
    assert "TODO: replace the line above" in texts["README.md"]
    assert texts["axcore_my_feature/__init__.py"] == f'"""{summary}"""\n'


def test_the_default_directory_is_the_one_the_help_names(tmp_path, monkeypatch, capsys):
    """The help said `./axcore-NAME` where `label_smoothing` was written to `./axcore-label-smoothing`."""
    with pytest.raises(SystemExit):
        main(["new-plugin", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    example = re.search(r"e\.g\. \./(\S+) for (\w+)\)", help_text)
    assert example and "./axcore-NAME with each '_' written '-'" in help_text, help_text
    monkeypatch.chdir(tmp_path)
    directory, name = example.groups()
    assert main(["new-plugin", name]) == 0
    assert main(["new-plugin", "label_smoothing", "--kind", "objective"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([directory, "axcore-label-smoothing"])


def test_the_command_offers_every_kind_the_scaffold_writes(capsys):
    with pytest.raises(SystemExit):
        main(["new-plugin", "--help"])
    offered = re.search(r"--kind \{([a-z_,]+)\}", capsys.readouterr().out).group(1).split(",")
    assert offered == list(KINDS)
