"""`axcore plugins`: --all, --json, --hook, components, and the AXCORE_LOAD_PLUGINS allow-list."""

import json
import sys
import textwrap

import pytest

import axcore
from axcore.cli import main
from axcore.cli.plugins import PLUGIN_JSON_KEYS
from axcore.experiment.builtins import create_plugin_manager
from axcore.layers import FeedForward
from axcore.plugin.loading import LOAD_PLUGINS_ENV, PluginExcludedError, installed_entry_points

TOP_KEYS = {"plugin_api_version", "experiment", "hook", "load_plugins", "autoload_disabled", "plugins"}
MODULES = ("axtest_listed_good", "axtest_listed_broken", "axtest_listed_secret")


class WidgetFeedForward(FeedForward):
    """A third-party layer."""


class Widgets:
    """Registers a layer and a command."""

    @axcore.hookimpl
    def axcore_register_layers(self, register):
        register("widget_feed_forward", WidgetFeedForward)

    @axcore.hookimpl
    def axcore_register_commands(self, register):
        register("widget-hello", lambda args: 0, help="say hello")


class Flags:
    """Implements a hook that registers nothing."""

    @axcore.hookimpl
    def axcore_xla_flags(self, instance_type):
        return None


OBJECTS = {"widgets": Widgets(), "flags": Flags()}


@pytest.fixture
def only_objects(monkeypatch):
    """No installed plugin may load, so listings hold the built-ins and the objects only."""
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "")


def _json(capsys, argv, objects=OBJECTS):
    assert main(argv, objects=objects) == 0
    return json.loads(capsys.readouterr().out)


def _by_name(document):
    return {p["name"]: p for p in document["plugins"]}


def test_json_lists_objects_with_hooks_components_and_stable_keys(only_objects, capsys):
    document = _json(capsys, ["plugins", "--json"])
    assert set(document) == TOP_KEYS
    assert document["plugin_api_version"] == axcore.PLUGIN_API_VERSION
    assert (document["experiment"], document["hook"], document["load_plugins"]) == (None, None, [])
    plugins = _by_name(document)
    loaded = {name for name, p in plugins.items() if p["status"] != "excluded"}
    assert loaded == {"widgets", "flags"}  # No built-ins without --all; installed ones are excluded.
    assert all(plugins[name]["source"] == "entry-point" for name in set(plugins) - loaded)
    widgets = plugins["widgets"]
    assert list(widgets) == list(PLUGIN_JSON_KEYS)
    assert (widgets["distribution"], widgets["source"], widgets["status"], widgets["enabled"]) == (
        "<local>", "object", "ok", False,
    )
    assert widgets["hooks"] == ["axcore_register_commands", "axcore_register_layers"]
    assert widgets["components"] == [
        {"family": "commands", "kind": "command", "name": "widget-hello", "override": False},
        {"family": "layers", "kind": "layer", "name": "widget_feed_forward", "override": False},
    ]
    assert plugins["flags"]["hooks"] == ["axcore_xla_flags"] and plugins["flags"]["components"] == []


def test_all_adds_builtins_with_their_components(only_objects, capsys):
    plugins = _by_name(_json(capsys, ["plugins", "--all", "--json"]))
    layers = plugins["axcore.layers.plugin"]
    assert (layers["source"], layers["distribution"], layers["enabled"]) == ("builtin", "axcore", True)
    names = {(c["kind"], c["name"]) for c in layers["components"]}
    assert {("layer", "multihead_attention"), ("layer", "feed_forward")} <= names
    kernels = {c["name"] for c in plugins["axcore.kernels.plugin"]["components"] if c["family"] == "kernels"}
    assert kernels and all("/" in name for name in kernels)  # OP/KERNEL.
    # Provenance: each component appears under the plugin that registered it, and only there.
    owners = [p["name"] for p in plugins.values() for c in p["components"] if c["name"] == "widget_feed_forward"]
    assert owners == ["widgets"]


def test_hook_lists_exactly_the_implementing_plugins(only_objects, capsys):
    pm = create_plugin_manager(list(OBJECTS), objects=OBJECTS)
    expected = {info.name for info in pm.plugins if "axcore_register_layers" in pm.hooks_of(info.name)}
    assert expected == {"axcore.layers.plugin", "widgets"}
    document = _json(capsys, ["plugins", "--hook", "axcore_register_layers", "--json"])
    assert document["hook"] == "axcore_register_layers"
    assert set(_by_name(document)) == expected
    assert set(_by_name(_json(capsys, ["plugins", "--hook", "axcore_xla_flags", "--json"]))) == {"flags"}


def test_unknown_hook_is_one_line_exit_2(only_objects, capsys):
    assert main(["plugins", "--hook", "axcore_register_layer"], objects=OBJECTS) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'axcore_register_layers'" in err


def test_experiment_marks_enabled_plugins(only_objects, tmp_path, capsys):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("plugins: [widgets]\n")
    document = _json(capsys, ["plugins", str(experiment), "--json"])
    assert document["experiment"] == str(experiment)
    plugins = _by_name(document)
    assert plugins["widgets"]["enabled"] is True and plugins["flags"]["enabled"] is False


def test_text_listing_shows_hooks_components_and_commands(only_objects, tmp_path, capsys):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("plugins: [widgets]\n")
    assert main(["plugins", str(experiment)], objects=OBJECTS) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "distribution", "version", "enabled", "hooks"]
    row = next(line for line in lines if line.startswith("widgets "))
    assert row.split()[:4] == ["widgets", "<local>", "0", "yes"] and "axcore_register_layers" in row
    registers = lines[lines.index(row) + 1].split()
    assert registers == ["registers:", "command", "widget-hello;", "layer", "widget_feed_forward"]
    assert any(line.split()[:2] == ["flags", "<local>"] for line in lines)
    assert not any(line.startswith("axcore.layers.plugin") for line in lines)
    assert "  axcore widget-hello  (plugin widgets) say hello" in lines


# -- Installed plugins and AXCORE_LOAD_PLUGINS --------------------------------------------


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Installs distribution axcore-listed 2.0.0 with entry points good, broken and secret."""
    dist_info = tmp_path / "axcore_listed-2.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: axcore-listed\nVersion: 2.0.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[axcore]\ngood = axtest_listed_good\nbroken = axtest_listed_broken\nsecret = axtest_listed_secret\n"
    )
    (tmp_path / "axtest_listed_good.py").write_text(textwrap.dedent("""
        import axcore
        from axcore.layers import Linear

        AXCORE_PLUGIN_API = ">=1.0"

        class Tripling(Linear):
            pass

        @axcore.hookimpl
        def axcore_register_layers(register):
            register("tripling_linear", Tripling)
    """))
    (tmp_path / "axtest_listed_broken.py").write_text("import a_module_that_does_not_exist\n")
    (tmp_path / "axtest_listed_secret.py").write_text("raise RuntimeError('excluded: must never be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # The repository's own installed plugins stay out of these listings.
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "good,broken")
    yield tmp_path
    for name in MODULES:
        sys.modules.pop(name, None)


def test_installed_plugins_broken_and_excluded(installed, capsys):
    plugins = _by_name(_json(capsys, ["plugins", "--json"], objects=None))
    good, broken, secret = plugins["good"], plugins["broken"], plugins["secret"]
    assert (good["distribution"], good["version"], good["source"], good["status"]) == (
        "axcore-listed", "2.0.0", "entry-point", "ok",
    )
    assert good["plugin_api"] == ">=1.0" and good["hooks"] == ["axcore_register_layers"]
    assert good["components"] == [{"family": "layers", "kind": "layer", "name": "tripling_linear", "override": False}]
    assert broken["status"] == "broken" and "ModuleNotFoundError" in broken["detail"]
    assert secret["status"] == "excluded" and LOAD_PLUGINS_ENV in secret["detail"] and secret["hooks"] == []
    assert "axtest_listed_secret" not in sys.modules
    assert "rope" in plugins and plugins["rope"]["status"] == "excluded"  # Installed with the repository.


def test_load_plugins_restricts_what_loads(installed, monkeypatch):
    assert {"good", "broken"} == set(installed_entry_points())
    assert "tripling_linear" in create_plugin_manager(["good"]).registries.layers
    with pytest.raises(PluginExcludedError, match=rf"'secret'.*{LOAD_PLUGINS_ENV}='good,broken' leaves it out"):
        create_plugin_manager(["secret"])
    assert "axtest_listed_secret" not in sys.modules
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "")  # Empty: none may load, not even for the platform.
    assert installed_entry_points() == {}
    assert "tripling_linear" not in create_plugin_manager([], platform="good").registries.layers
    with pytest.raises(PluginExcludedError, match="'good'"):
        create_plugin_manager(["good"])
    monkeypatch.delenv(LOAD_PLUGINS_ENV)  # Unset: all may.
    assert {"good", "broken", "secret"} <= set(installed_entry_points())


def test_excluded_plugin_in_an_experiment_is_one_line_exit_2(installed, tmp_path, capsys):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("plugins: [secret]\n")
    assert main(["config", str(experiment)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'secret'" in err and LOAD_PLUGINS_ENV in err


def test_help_documents_the_environment_variables(capsys):
    with pytest.raises(SystemExit):
        main(["plugins", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "AXCORE_LOAD_PLUGINS" in out and "AXCORE_DISABLE_PLUGIN_AUTOLOAD" in out
    assert "--json" in out and "--hook NAME" in out and "--all" in out
