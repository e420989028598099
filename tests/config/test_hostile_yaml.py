"""Hostile YAML: size, depth and alias-expansion limits, non-UTF-8, duplicate keys, tags.

Every failure is a one-line ConfigError naming the file (or `--set PATH`) and the
problem; the CLI prints it and exits 2.
"""

import time
import tracemalloc

import pytest

from axcore.cli import main
from axcore.config import parse_override
from axcore.config.safe_yaml import MAX_BYTES, MAX_DEPTH, MAX_NODES, HardenedLoader, YAMLInputError, load
from axcore.errors import ConfigError
from axcore.experiment import builtin_experiments, read_experiment_file


def _billion_laughs(levels: int = 9) -> str:
    lines = ["mesh:", "  axis_rules:", "    a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        prev, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"    {name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines) + "\n"


def _write(tmp_path, content, name="exp.yaml"):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def _error(tmp_path, content) -> str:
    path = _write(tmp_path, content)
    with pytest.raises(ConfigError) as info:
        read_experiment_file(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


def test_billion_laughs_fails_fast_and_small(tmp_path):
    path = _write(tmp_path, _billion_laughs())
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(YAMLInputError, match=rf"expands to more than {MAX_NODES} nodes"):
            read_experiment_file(path)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 10, elapsed
    assert peak < 50 * 2**20, peak


def test_merge_key_bomb_is_refused(tmp_path):
    text = "a: &m0 {x: 1, y: 2}\n" + "".join(f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}]}}\n" for i in range(1, 40))
    assert "expands to more than" in _error(tmp_path, text)


def test_deep_nesting_is_refused(tmp_path):
    assert f"nesting deeper than {MAX_DEPTH} levels" in _error(tmp_path, "a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert f"nesting deeper than {MAX_DEPTH}" in _error(tmp_path, "a: " + "{a: " * 100 + "1" + "}" * 100 + "\n")
    load("a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))  # Just within the limit.


def test_nesting_through_aliases_is_limited(tmp_path):
    half = MAX_DEPTH - 10
    text = f"a: &a {'[' * half}1{']' * half}\nb: {'[' * half}*a{']' * half}\n"
    assert "levels through aliases" in _error(tmp_path, text)


@pytest.mark.parametrize("text", ["a: &a [1, *a]\n", "a: &a {b: *a}\n"])
def test_recursive_alias_is_refused(tmp_path, text):
    assert "recursive alias" in _error(tmp_path, text)


def test_duplicate_keys_are_refused(tmp_path):
    message = _error(tmp_path, "model:\n  num_layers: 2\ntrainer: {}\nmodel: {}\n")
    assert "duplicate key 'model' at line 4 (first at line 1)" in message
    assert "duplicate key 'x' at line 2" in _error(tmp_path, "a: {x: 1,\n  x: 2}\n")
    assert "duplicate key 1" in _error(tmp_path, "1: a\n0x1: b\n")  # Same key, spelled differently.
    # Merge keys may be overridden: that is what `<<` is for.
    assert load("a: &a {x: 1}\nb: {<<: *a, x: 2}\n") == {"a": {"x": 1}, "b": {"x": 2}}


def test_non_utf8_file_is_refused_naming_the_offset(tmp_path):
    message = _error(tmp_path, b"model:\n  name: caf\xe9\n")
    assert "not valid UTF-8: byte 0xe9 at byte offset 18" in message
    assert "not valid UTF-8" in _error(tmp_path, "a: 1\n".encode("utf-16"))
    assert read_experiment_file(_write(tmp_path, "\ufeffmodel: {}\n".encode()))[0] == {"model": {}}  # BOM ok.


def test_oversized_file_is_refused_before_parsing(tmp_path):
    message = _error(tmp_path, "a: [" + "1, " * (MAX_BYTES // 3 + 10) + "1]\n")
    assert f"larger than the limit of {MAX_BYTES} bytes" in message
    with pytest.raises(YAMLInputError, match="larger than the limit"):
        load("x" * (MAX_BYTES + 1))


def test_too_many_nodes_is_refused(monkeypatch):
    monkeypatch.setattr(HardenedLoader, "max_nodes", 1000)  # MAX_NODES works the same, only slower.
    with pytest.raises(YAMLInputError, match="^big.yaml: more than 1000 nodes"):
        load("[" + "0," * 1001 + "0]", "big.yaml")
    assert len(load("[" + "0," * 998 + "0]")) == 999


@pytest.mark.parametrize(
    "text",
    [
        "x: !!python/object/apply:os.system ['true']\n",
        "x: !!python/object:collections.OrderedDict {}\n",
        "x: !!python/name:os.system\n",
        "x: !custom 1\n",
    ],
)
def test_python_and_unknown_tags_are_refused(tmp_path, text):
    message = _error(tmp_path, text)
    assert "could not determine a constructor for the tag" in message


@pytest.mark.parametrize(
    "text, problem",
    [
        ("a: [1, 2\n", "invalid YAML"),
        ("a: \x00\n", "unacceptable character"),
        ("a: 1\n---\nb: 2\n", "expected a single document"),
        ("a: " + "9" * 5000 + "\n", "invalid YAML value"),
        ("a: 2020-13-45\n", "invalid YAML value"),
        ("a: *nowhere\n", "undefined alias"),
    ],
)
def test_other_bad_input_is_one_line(tmp_path, text, problem):
    assert problem in _error(tmp_path, text)


def test_set_values_use_the_hardened_loader():
    assert parse_override("optimizer.learning_rate=1e-4") == ("optimizer.learning_rate", 1e-4)
    laughs = ", ".join(line.strip() for line in _billion_laughs().splitlines()[2:])
    with pytest.raises(YAMLInputError, match=r"^--set mesh\.axis_rules: expands to more than") as info:
        parse_override(f"mesh.axis_rules={{{laughs}}}")
    with pytest.raises(YAMLInputError, match=r"^--set model: duplicate key 'a'"):
        parse_override("model={a: 1, a: 2}")
    with pytest.raises(YAMLInputError, match=r"^--set model\.x: .*python/object"):
        parse_override("model.x=!!python/object/apply:os.system ['true']")
    assert "\n" not in str(info.value)


def test_builtin_experiments_still_load():
    for name in builtin_experiments():
        data, label = read_experiment_file(name)
        assert isinstance(data, dict), (name, label)


@pytest.mark.parametrize(
    "content, problem",
    [
        (_billion_laughs(), "expands to more than"),
        (b"model: {}\n\xff\n", "not valid UTF-8"),
        ("a: 1\na: 2\n", "duplicate key 'a'"),
        ("a: &a [*a]\n", "recursive alias"),
        ("x: !!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
    ],
)
def test_cli_reports_one_line_and_exits_2(tmp_path, capsys, content, problem):
    path = _write(tmp_path, content)
    assert main(["config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and problem in lines[0], err
