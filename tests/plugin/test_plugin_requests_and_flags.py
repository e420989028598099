"""The plugin kernel's small pure parts: parsing a `plugins:` entry (axcore/plugin/requests.py) and
merging the plugins' compiler-flag answers (axcore/plugin/flags.py), without a plugin manager."""

import pytest

from axcore.errors import ConfigError, PluginConflictError, PluginLoadError
from axcore.plugin.flags import choose_flags_environment, merge_xla_flags
from axcore.plugin.requests import PluginRequest


@pytest.mark.parametrize(
    ("text", "name", "specifier"),
    [("rope", "rope", ""), ("rope>=0.2", "rope", ">=0.2"), ("my_feature ~= 1.4", "my_feature", "~=1.4"),
     ("moe>=0.1,<2", "moe", "<2,>=0.1")],
)
def test_an_entry_is_a_name_and_an_optional_specifier(text, name, specifier):
    assert PluginRequest.parse(text) == PluginRequest(name, specifier)


@pytest.mark.parametrize(
    ("entry", "phrase"),
    [(3, "entries must be plugin names, got 3"), ("rope[fast]", "only NAME[SPECIFIER]"),
     ("rope; python_version > '3'", "only NAME[SPECIFIER]"), ("rope @ https://example.com/r.whl", "only NAME[SPECIFIER]"),
     ("not a name!", "is not a plugin name with an optional version specifier")],
)
def test_anything_else_is_a_config_error_naming_the_entry(entry, phrase):
    with pytest.raises(ConfigError, match=r"'plugins\[2\]'") as raised:
        PluginRequest.parse(entry, "plugins[2]")
    assert phrase in str(raised.value)


def test_flags_of_several_plugins_merge_with_values_spelled_as_xla_reads_them():
    answers = [("gpu", "axcore-gpu", {"xla_a": True, "xla_b": 4}), ("fp8", "axcore-fp8", {"xla_c": "x", "xla_a": "true"})]
    assert merge_xla_flags(answers) == {"xla_a": "true", "xla_b": "4", "xla_c": "x"}
    assert merge_xla_flags([]) == {}


def test_one_flag_with_two_values_names_the_first_owner_and_the_newcomer():
    answers = [("one", "d1", {"xla_a": "true"}), ("two", "d2", {"xla_b": "1"}), ("three", "d3", {"xla_a": False})]
    with pytest.raises(PluginConflictError, match="Plugins 'one' and 'three' set XLA flag xla_a to 'true' and 'false'"):
        merge_xla_flags(answers)


@pytest.mark.parametrize(
    ("answer", "error", "phrase"),
    [(["xla_a"], PluginLoadError, "Plugin 'p' (dist-p): axcore_xla_flags returned list"),
     ({"--xla_a": 1}, ConfigError, "flag --xla_a of plugin 'p': '--xla_a' is not an XLA flag name"),
     ({"xla_a": "a b"}, ConfigError, "contains whitespace")],
)
def test_a_malformed_answer_names_the_plugin(answer, error, phrase):
    with pytest.raises(error) as raised:
        merge_xla_flags([("p", "dist-p", answer)])
    assert phrase in str(raised.value)


def test_the_flags_variable_is_xla_flags_unless_plugins_agree_on_another():
    assert choose_flags_environment([], "gpu-h100-8") == "XLA_FLAGS"
    assert choose_flags_environment([("tpu", "LIBTPU_INIT_ARGS"), ("x", "LIBTPU_INIT_ARGS")], "tpu-v5p-8") == "LIBTPU_INIT_ARGS"
    with pytest.raises(PluginConflictError, match="Plugins 'tpu' and 'x' want the compiler flags of tpu-v5p-8 in "
                                                  "LIBTPU_INIT_ARGS and XLA_FLAGS"):
        choose_flags_environment([("tpu", "LIBTPU_INIT_ARGS"), ("x", "XLA_FLAGS")], "tpu-v5p-8")
