"""`axcore --help` lists the commands installed plugins add, without importing any plugin.

A temporary `*.dist-info` on the path simulates `pip install` (as in test_entry_points.py);
an editable install (`pip install -e`, as a contributor installs the hardware plugins) is
made for real in a throwaway venv.
"""

import os
import subprocess
import sys

import pytest

from axcore.experiment import search_plugins
from axcore.plugin.commands import listed_plugin_commands

from throwaway_venv import install_editable, make_venv

WIDGET = '''
import jax  # A plugin's module may be heavy: the help must not import it.

import axcore

PROBE_FILE.write_text("imported")


@axcore.hookimpl
def axcore_register_commands(register):
    register("widgetize", lambda args: 0, help="turn runs into widgets")
    register("unwidget", lambda args: 0)
'''
COMPUTED = '''
import axcore

NAME = "comp" + "uted"


@axcore.hookimpl
def axcore_register_commands(register):
    register(NAME, lambda args: 0, help="a computed name")
'''


def _install(root, probe):
    dist_info = root / "axcore_widgets-1.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: axcore-widgets\nVersion: 1.0.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[axcore]\nwidget = axcore_widget_plugin\nbroken = axcore_broken_plugin\n"
        "computed = axcore_computed_plugin:Plugin\nmissing = axcore_nowhere.plugin\n"
    )
    (root / "axcore_widget_plugin.py").write_text(WIDGET.replace("PROBE_FILE", f"__import__('pathlib').Path({str(probe)!r})"))
    (root / "axcore_broken_plugin.py").write_text("def axcore_register_commands(register:\n")  # A syntax error.
    (root / "axcore_computed_plugin.py").write_text(COMPUTED)


def _help(root, **env):
    code = (
        "import sys; from axcore.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
        "    print('exit', e.code)\nprint('jax imported:', 'jax' in sys.modules)"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)


def test_help_lists_plugin_commands_and_names_broken_plugins_without_importing_them(tmp_path):
    probe = tmp_path / "imported.txt"
    _install(tmp_path, probe)
    result = _help(tmp_path)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and "exit 0" in lines and "jax imported: False" in lines, result.stderr
    assert not probe.exists()  # The plugin's module never ran.
    assert any(
        line.split() == ["widgetize", "turn", "runs", "into", "widgets", "[plugin", "widget,", "axcore-widgets]"]
        for line in lines
    ), result.stdout
    assert any(line.split() == ["unwidget", "(no", "description)", "[plugin", "widget,", "axcore-widgets]"] for line in lines)
    problems = {line.split("'")[1]: line for line in lines if line.startswith("Plugin '")}
    assert set(problems) == {"broken", "computed", "missing"}, result.stdout
    assert "axcore_broken_plugin" in problems["broken"] and "axcore plugins" in problems["broken"]
    assert "only loading it can name" in problems["computed"]
    assert "axcore_nowhere is not installed" in problems["missing"]
    # Commands come first in the section, sorted by name.
    names = [line.split()[0] for line in lines if line.endswith("axcore-widgets]")]
    assert names == ["unwidget", "widgetize"]

    # AXCORE_LOAD_PLUGINS: only the listed plugins; AXCORE_DISABLE_PLUGIN_AUTOLOAD: none (they could not run).
    only = _help(tmp_path, AXCORE_LOAD_PLUGINS="widget").stdout
    assert "widgetize" in only and "Plugin 'broken'" not in only
    disabled = _help(tmp_path, AXCORE_DISABLE_PLUGIN_AUTOLOAD="1").stdout
    assert "widgetize" not in disabled and "not listed (AXCORE_DISABLE_PLUGIN_AUTOLOAD is set)" in disabled


def test_the_listing_agrees_with_the_commands_the_installed_plugins_register():
    """What the help reads from the sources is what loading the installed plugins registers."""
    listing = listed_plugin_commands()
    search = search_plugins("commands")
    loaded = {
        (name, entry.provenance.plugin, entry.value.help)
        for name, entry in search.found.items()
        if entry.provenance.plugin not in search.broken
    }
    assert {(c.name, c.plugin, c.help) for c in listing.commands} == loaded
    assert not listing.unreadable


EDITABLE = '''
import axcore


@axcore.hookimpl
def axcore_register_commands(register):
    register("edwidgetize", lambda args: 0, help="an editable plugin's command")
'''


@pytest.mark.slow
def test_help_lists_the_commands_of_an_editable_install_run_beside_its_source(tmp_path):
    """`pip install -e ./axcore_edwidget`, then `axcore --help` in the folder holding the project.

    The project's folder has the package's name (as `axcore_gpu/axcore_gpu/` in axcore's
    repository), so from there the import system first sees that folder as a namespace
    package and only setuptools' editable finder maps `axcore_edwidget.plugin`: the listing
    must follow the finders as `import` does.
    """
    project = tmp_path / "axcore_edwidget"
    (project / "axcore_edwidget").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "axcore-edwidget"\nversion = "0.1.0"\n\n'
        '[project.entry-points.axcore]\nedwidget = "axcore_edwidget.plugin"\n\n'
        '[tool.setuptools]\npackages = ["axcore_edwidget"]\n'
    )
    (project / "axcore_edwidget" / "__init__.py").write_text("")
    (project / "axcore_edwidget" / "plugin.py").write_text(EDITABLE)
    python = make_venv(tmp_path / "venv")
    install_editable(python, [project])
    code = "from axcore.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n    print('exit', e.code)"
    check = "import axcore_edwidget.plugin as m; print(m.__file__)"
    for cwd in (tmp_path, tmp_path / "venv"):  # Beside the project, and elsewhere.
        result = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
        lines = result.stdout.splitlines()
        assert "exit 0" in lines, result.stderr[-3000:]
        assert "Plugin 'edwidget'" not in result.stdout, result.stdout
        assert any(
            line.split() == ["edwidgetize", "an", "editable", "plugin's", "command", "[plugin", "edwidget,",
                             "axcore-edwidget]"]
            for line in lines
        ), result.stdout
        imported = subprocess.run([python, "-c", check], cwd=cwd, capture_output=True, text=True, timeout=120)
        assert imported.stdout.strip() == str(project / "axcore_edwidget" / "plugin.py"), imported.stderr
