"""The hookspec evolution policy (axcore/plugin/hookspecs.py): specs only gain arguments,
old plugins keep working, deprecations warn through `warn_on_impl`, and plugins can
require a plugin API version."""

import inspect
import types
import warnings

import pluggy
import pytest

import axcore
from axcore.cli.plugins import describe_plugins
from axcore.config import replace
from axcore.errors import PluginLoadError, PluginVersionError
from axcore.experiment.builtins import create_plugin_manager
from axcore.layers import CausalLM, MultiheadAttention
from axcore.plugin import hookspecs
from axcore.plugin.loading import API_REQUIREMENT_ATTRIBUTE

# Every hook of plugin API 1.0 and its arguments. A later spec may add hooks and
# arguments; one listed here may lose neither (deprecate with warn_on_impl first,
# remove at the next major version and update this table then).
API_1_0 = {
    "axcore_add_hookspecs": ["add_hookspecs"],
    "axcore_register_layers": ["register"],
    "axcore_register_position_embeddings": ["register"],
    "axcore_register_attention_kernels": ["register"],
    "axcore_register_ops": ["register"],
    "axcore_register_kernels": ["register"],
    "axcore_register_mesh_rules": ["register"],
    "axcore_register_config_modifiers": ["register"],
    "axcore_register_checkpoint_backends": ["register"],
    "axcore_register_data_sources": ["register"],
    "axcore_register_optimizers": ["register"],
    "axcore_register_schedules": ["register"],
    "axcore_register_tokenizers": ["register"],
    "axcore_register_metrics_writers": ["register"],
    "axcore_register_experiments": ["register"],
    "axcore_register_commands": ["register"],
    "axcore_probe_instance_type": [],
    "axcore_xla_flags": ["instance_type"],
    "axcore_flags_environment": ["instance_type"],
    "axcore_settings_config": [],
    "axcore_transform_config": ["config", "settings", "registries"],
}


def test_plugin_api_version_is_exported():
    assert axcore.PLUGIN_API_VERSION == hookspecs.PLUGIN_API_VERSION
    major, _minor = (int(part) for part in hookspecs.PLUGIN_API_VERSION.split("."))
    assert major == 1, "a new major version: update API_1_0 to the new baseline"


@pytest.mark.parametrize("hook", sorted(API_1_0))
def test_hookspecs_only_gain_arguments(hook):
    spec = getattr(hookspecs, hook, None)
    assert spec is not None, f"{hook} of plugin API 1.0 was removed; deprecate it with warn_on_impl instead"
    arguments = list(inspect.signature(spec).parameters)
    assert set(API_1_0[hook]) <= set(arguments), f"{hook} lost arguments: {set(API_1_0[hook]) - set(arguments)}"


def test_policy_is_written_down():
    doc = hookspecs.__doc__
    assert "only gain arguments" in doc and "warn_on_impl" in doc and API_REQUIREMENT_ATTRIBUTE in doc


# -- Old plugins (fewer arguments) keep working --------------------------------------------


def test_pluggy_passes_an_implementation_only_the_arguments_it_declares():
    mark_spec, mark_impl = pluggy.HookspecMarker("policy"), pluggy.HookimplMarker("policy")

    class Spec:
        @mark_spec
        def policy_hook(self, a, b): ...

    class Old:
        @mark_impl
        def policy_hook(self, a):
            return a

    pm = pluggy.PluginManager("policy")
    pm.add_hookspecs(Spec)
    pm.register(Old())
    pm.check_pending()
    assert pm.hook.policy_hook(a=1, b=2) == [1]


def test_axcore_plugin_with_fewer_arguments_than_the_spec_works():
    class OldPlugin:
        @axcore.hookimpl
        def axcore_xla_flags(self):  # The spec also passes instance_type.
            return {"xla_old_plugin_flag": True}

        @axcore.hookimpl
        def axcore_transform_config(self, config):  # The spec also passes settings and registries.
            return replace(config, MultiheadAttention, lambda path, c: c.set(scale=0.5))

    pm = create_plugin_manager(["old"], objects={"old": OldPlugin()})
    assert pm.xla_flags("cpu-1")["xla_old_plugin_flag"] == "true"
    config = pm.transform_config(CausalLM.default_config())
    assert config.decoder.layer.self_attention.scale == 0.5


# -- Deprecation through warn_on_impl ------------------------------------------------------


class DeprecatedSpecs:
    """Test-only hooks, added through axcore_add_hookspecs (no real hook is deprecated)."""

    @axcore.hookspec(warn_on_impl=DeprecationWarning("axcore_policy_old is deprecated; implement axcore_policy_new"))
    def axcore_policy_old(self) -> None: ...

    @axcore.hookspec(warn_on_impl_args={"legacy": DeprecationWarning("argument 'legacy' is deprecated")})
    def axcore_policy_args(self, value, legacy) -> None: ...


class Declares:
    @axcore.hookimpl
    def axcore_add_hookspecs(self, add_hookspecs):
        add_hookspecs(DeprecatedSpecs)


def test_implementing_a_deprecated_hook_warns_when_registered():
    class Old:
        @axcore.hookimpl
        def axcore_policy_old(self):
            return None

    with pytest.warns(DeprecationWarning, match="axcore_policy_old is deprecated"):
        create_plugin_manager(["declares", "old"], objects={"declares": Declares(), "old": Old()})


def test_deprecated_argument_warns_only_implementations_that_use_it():
    class UsesLegacy:
        @axcore.hookimpl
        def axcore_policy_args(self, value, legacy):
            return None

    class Current:
        @axcore.hookimpl
        def axcore_policy_args(self, value):
            return None

    with pytest.warns(DeprecationWarning, match="'legacy' is deprecated"):
        create_plugin_manager(["declares", "legacy"], objects={"declares": Declares(), "legacy": UsesLegacy()})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        create_plugin_manager(["declares", "current"], objects={"declares": Declares(), "current": Current()})


# -- Requiring a plugin API version ---------------------------------------------------------


def _module_plugin(requirement):
    module = types.ModuleType("axtest_api_plugin")
    setattr(module, API_REQUIREMENT_ATTRIBUTE, requirement)
    return module


def test_plugin_requiring_a_matching_api_loads():
    major = hookspecs.PLUGIN_API_VERSION.split(".")[0]
    create_plugin_manager(["ok"], objects={"ok": _module_plugin(f">={hookspecs.PLUGIN_API_VERSION},<{int(major) + 1}")})


def test_plugin_requiring_a_newer_api_fails_with_one_line():
    with pytest.raises(PluginVersionError) as info:
        create_plugin_manager(["future"], objects={"future": _module_plugin(">=99.0")})
    message = str(info.value)
    assert "\n" not in message
    assert "'future' (distribution <local>) requires axcore plugin API >=99.0" in message
    assert f"provides plugin API {hookspecs.PLUGIN_API_VERSION}" in message


def test_class_attribute_requirement_and_invalid_specifier():
    class Future:
        AXCORE_PLUGIN_API = ">=99.0"

    with pytest.raises(PluginVersionError, match="'future'"):
        create_plugin_manager(["future"], objects={"future": Future()})
    pattern = rf"'bad'.*{API_REQUIREMENT_ATTRIBUTE} = 'banana'.*not a version specifier"
    with pytest.raises(PluginLoadError, match=pattern):
        create_plugin_manager(["bad"], objects={"bad": _module_plugin("banana")})


def test_listing_shows_an_incompatible_plugin_as_broken(monkeypatch):
    monkeypatch.setenv("AXCORE_LOAD_PLUGINS", "")
    described = {d.name: d for d in describe_plugins(objects={"future": _module_plugin(">=99.0")})}
    assert described["future"].status == "broken" and "requires axcore plugin API >=99.0" in described["future"].detail
