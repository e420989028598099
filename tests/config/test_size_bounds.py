"""Sizes, dtypes and unknown keys: a bad value is one line naming its path, found before anything is built.

Every field declaring a `Size` (core layers, the input, and the settings of the rope,
moe and swiglu plugins) is set past both ends of its bound and past int64 through
`axcore config`, in a subprocess under a 4 GiB address-space limit: each case exits
2 with exactly one line naming the path, the value and the bound, no traceback, and
the process's peak memory grows by less than 200 MB over all cases (a model built in
proportion to a bad value fails the limit instead of the machine).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import typing

import numpy as np
import pytest

from axcore import cli
from axcore.config import ConfigBase, ConfigValidationError, Size, from_dict, raise_collected
from axcore.config.constraints import Depth, Length, Width, split_constraints
from axcore.errors import UnknownFieldError
from axcore.experiment import ExperimentConfig, load_experiment
from axcore.experiment.validation import parameter_bytes_problem
from axcore.params import ParameterSpec, constant

WORKER = pathlib.Path(__file__).with_name("size_bounds_worker.py")
# Address space the worker may map: JAX and a failing `axcore config` need well under it (measured: 0.9 GB
# of peak resident memory); a billion layer configs (the reported num_layers=10**9) need more than 6 GB.
ADDRESS_SPACE = 4 * 2**30
# Growth of the worker's peak resident memory over every case after the first.
MAX_GROWTH_KB = 200 * 1024
# Plugins whose settings declare sizes, enabled for the cases of their settings.
PLUGINS = "plugins=[moe, rope, swiglu]"


def _size_of(annotation) -> Size | None:
    """The `Size` constraint an annotation (possibly Optional) declares, or None."""
    for member in [annotation, *typing.get_args(split_constraints(annotation)[0])]:
        found = [c for c in split_constraints(member)[1] if isinstance(c, Size)]
        if found:
            return found[0]
    return None


def _sized_fields(cfg: ConfigBase, path: str = "") -> list[tuple[str, Size]]:
    """`(path, Size)` of every field of the tree that declares a Size."""
    out = []
    for name, value in cfg.items():
        where = f"{path}.{name}" if path else name
        if isinstance(value, ConfigBase):
            out += _sized_fields(value, where)
        elif (size := _size_of(type(cfg).field_types()[name])) is not None:
            out.append((where, size))
    return out


def _cases() -> list[tuple[list[str], str, int, Size]]:
    """`(overrides, path, value, size)`: each sized field past its bounds, and past int64 both ways."""
    core = [([], path, size) for path, size in _sized_fields(ExperimentConfig())]
    settings = load_experiment("default", [PLUGINS]).settings
    plugin = [([PLUGINS], p, s) for name, cfg in settings.items() if cfg is not None for p, s in _sized_fields(cfg, name)]
    return [
        (extra, path, value, size)
        for extra, path, size in core + plugin
        for value in (size.minimum - 1, -(2**63), size.limit + 1, 2**63)
    ]


def _run_worker(argvs: list[list[str]]) -> dict:
    """The worker's report on `argvs`, run under the address-space limit (set before it imports anything)."""
    start = (
        f"import resource, runpy; resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE})); "
        f"runpy.run_path({str(WORKER)!r}, run_name='__main__')"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", start], input=json.dumps(argvs), capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _assert_one_line(result: dict, path: str, *needles: str) -> str:
    err = result["stderr"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert result["status"] == 2, f"{path}: exit {result['status']}:\n{err[-2000:]}"
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("axcore: error: "), err
    for needle in (f"'{path}'", *needles):
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def test_the_bounds_fit_int32_indices_and_int64_shapes():
    """Lengths index with int32; Width and Depth below it; a parameter of the largest widths fits int64 bytes."""
    assert Length.limit == np.iinfo(np.int32).max
    assert Width.limit < Length.limit and Depth.limit < Width.limit
    # The largest matrices of a model at the bounds (vocab x width, width x width) in float32 bytes.
    assert Length.limit * Width.limit * 4 < np.iinfo(np.int64).max
    assert Depth.limit * Width.limit**2 * 4 < np.iinfo(np.int64).max


def test_every_size_field_past_its_bounds_is_one_line_in_bounded_memory():
    cases = _cases()
    paths = {path for _, path, _, _ in cases}
    # The fields the issue named, and the plugins' sizes, are among those declared.
    assert {"model.vocab_size", "model.dim", "model.num_layers", "model.position_embedding.max_len"} <= paths
    assert {"input.seq_len", "input.batch_size", "model.decoder.layer.self_attention.num_heads"} <= paths
    assert {"moe.num_experts", "moe.every", "rope.original_max_len", "swiglu.hidden_dim_multiple_of"} <= paths
    argvs = [["config", "default", "--set", f"{path}={value}", *[a for o in extra for a in ("--set", o)]]
             for extra, path, value, _ in cases]
    report = _run_worker([["config", "default", "--set", "model.dim=0"], *argvs])
    for (_, path, value, size), result in zip(cases, report["results"][1:]):
        _assert_one_line(result, path, f"got {value}", f"from {size.minimum} to {size.limit}")
    assert report["maxrss_growth_kb"] < MAX_GROWTH_KB, report["maxrss_growth_kb"]


@pytest.mark.parametrize(
    "override, path, needles",
    [
        ("model.param_dtype=int8", "model.param_dtype", ["floating dtype", "'int8'", "float32"]),
        ("model.vocab_size=10000000000", "model.vocab_size", ["10000000000", "2147483647", "int32"]),
        ("model.position_embedding.max_len=1000000000000", "model.position_embedding.max_len", ["1000000000000", "2147483647"]),
        (f"model.dim={2**63}", "model.dim", [str(2**63), "1048576"]),
        ("model.num_layers=1000000000", "model.num_layers", ["1000000000", "1024"]),
        (f"trainer.max_steps={2**64}", "trainer.max_steps", [str(2**64), str(2**63 - 1), "int64"]),
    ],
)
def test_the_reported_cases_are_one_line_each(override, path, needles):
    """The review's cases (a TypeError from jax.grad, OverflowErrors, a 6 GB num_layers), in bounded memory."""
    report = _run_worker([["config", "default", "--set", override]])
    _assert_one_line(report["results"][0], path, *needles)


def test_a_billion_layers_with_moe_are_refused_before_its_transform_builds_a_config_per_layer():
    report = _run_worker([["config", "default", "--set", "plugins=[moe]", "--set", "model.num_layers=1000000000"]])
    _assert_one_line(report["results"][0], "model.num_layers", "from 1 to 1024")


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "bool"])
@pytest.mark.parametrize(
    "path",
    [
        "model.param_dtype",
        "model.compute_dtype",
        "model.decoder.layer.self_attention.param_dtype",  # A per-layer override.
        "model.decoder.layer.feed_forward.compute_dtype",
        "model.lm_head.output_dtype",
        "trainer.learner.optimizer.moment_dtype",
    ],
)
def test_integer_and_bool_dtypes_are_refused_where_values_are_differentiated(path, dtype, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "default", "--set", f"{path}={dtype}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"axcore: error: '{path}' must be a floating dtype (gradients flow through these values), got '{dtype}'; "
        f"use float32, bfloat16 or float16."
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_floating_dtypes_are_accepted(dtype):
    cfg = load_experiment("default", [f"model.param_dtype={dtype}", f"model.decoder.layer.compute_dtype={dtype}"]).config
    assert cfg.model.param_dtype == np.dtype(dtype) and cfg.model.decoder.layer.compute_dtype == np.dtype(dtype)


def test_values_at_the_bounds_are_accepted():
    cfg = load_experiment("default", [f"model.vocab_size={Length.limit}", f"model.num_layers={Depth.limit}",
                                      "model.decoder.layer.feed_forward.hidden_dim=1048576"]).config
    assert (cfg.model.vocab_size, cfg.model.num_layers) == (2**31 - 1, 1024)


def test_parameter_bytes_past_int64_are_refused_by_count_not_by_overflow():
    """Bytes are counted in Python ints: 2**61 float32 elements are 2**63 bytes, one past the int64 range."""
    init = constant(0.0)
    fits = {"a": ParameterSpec((2**61 - 1,), np.dtype("float32"), init)}  # 2**63 - 4 bytes.
    assert parameter_bytes_problem(fits) is None
    a, c = ParameterSpec((3, 2**59), np.dtype("float32"), init), ParameterSpec((2**59,), np.dtype("float32"), init)
    problem = parameter_bytes_problem({"a": a, "b": {"c": c}})  # 3 * 2**61 + 2**61 bytes.
    assert problem is not None and f"need {2**63} bytes" in problem
    assert f"the largest parameter, 'a', {3 * 2**61})" in problem
    assert parameter_bytes_problem({"a": ParameterSpec((2**30, 2**30), np.dtype("bfloat16"), init)}) is None


def test_a_model_whose_parameters_overflow_int64_is_one_line(capsys, tmp_path, monkeypatch):
    """Each width within its bound, their product past int64: 4 MoE layers of 2**20 experts of 2**20 x 2**20."""
    monkeypatch.chdir(tmp_path)
    argv = ["config", "default", "--set", "plugins=[moe]", "--set", "moe.num_experts=1048576", "--set",
            "model.dim=1048576", "--set", "model.decoder.layer.feed_forward.hidden_dim=1048576"]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # Two MoE layers (every 2nd of 4), each with up_proj and down_proj of 2**60 float32 elements (2**62 bytes).
    assert len(lines) == 1 and lines[0].startswith("axcore: error: 'model': its parameters need ")
    total = int(lines[0].split("need ")[1].split(" bytes")[0])
    assert total > 4 * 2**62 and "int64 range (9223372036854775807)" in lines[0]


_SEVERAL_UNKNOWN = """\
modle: {}
model:
  dimm: 64
  decoder:
    layer:
      self_atention: {num_heads: 2}
      feed_forward: {hiden_dim: 128}
trainer:
  max_stepz: 5
  learner: {learning_rat: 0.1}
input: {seq_lenn: 16}
"""
# Path of each unknown key above, and the suggestion its line must carry.
_UNKNOWN = {
    "modle": "'model'",
    "model.dimm": "'dim'",
    "model.decoder.layer.self_atention": "'self_attention'",
    "model.decoder.layer.feed_forward.hiden_dim": "'hidden_dim'",
    "trainer.max_stepz": "'max_steps'",
    "trainer.learner.learning_rat": "'learning_rate'",
    "input.seq_lenn": "'seq_len'",
}


def test_every_unknown_key_of_an_experiment_file_is_reported_in_one_pass(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(_SEVERAL_UNKNOWN)
    with pytest.raises(ConfigValidationError) as info:
        load_experiment(str(path), ["trainer.log_evry=3"])
    problems = info.value.problems
    assert len(problems) == len(_UNKNOWN) + 1, problems
    for key, suggestion in {**_UNKNOWN, "trainer.log_evry": "'log_every'"}.items():
        line = next(p for p in problems if f"'{key}'" in p)
        assert f"(did you mean {suggestion}?)" in line, line


def test_the_cli_prints_every_unknown_key_one_per_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "exp.yaml").write_text(_SEVERAL_UNKNOWN)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "exp.yaml"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == len(_UNKNOWN)
    assert all(line.startswith("axcore: error: ") for line in lines)
    assert {next(k for k in _UNKNOWN if f"'{k}'" in line) for line in lines} == set(_UNKNOWN)


def test_collecting_merge_keeps_the_good_keys_and_raises_a_single_error_as_itself(registries):
    errors = []
    cfg = from_dict({"model": {"dimm": 3, "dim": 96, "num_layres": 1, "num_layers": 3}}, registries, ExperimentConfig(),
                    errors=errors)
    assert (cfg.model.dim, cfg.model.num_layers) == (96, 3)  # Merged around the two bad keys.
    assert [type(e) for e in errors] == [UnknownFieldError, UnknownFieldError]
    with pytest.raises(ConfigValidationError) as info:
        raise_collected(errors)
    assert ["model.dimm" in info.value.problems[0], "model.num_layres" in info.value.problems[1]] == [True, True]
    with pytest.raises(UnknownFieldError, match="did you mean 'dim'"):
        raise_collected(errors[:1])
    raise_collected([])  # Nothing collected: nothing raised.


def test_every_bad_key_of_plugin_settings_is_reported_with_the_rest(tmp_path):
    """Plugins' settings are merged like the rest: every unknown key of every plugin, in the same pass."""
    path = tmp_path / "exp.yaml"
    path.write_text("plugins: [rope, swiglu]\nrope: {thta: 10000, scalng: llama3}\nmodel: {dimm: 8}\n")
    with pytest.raises(ConfigValidationError) as info:
        load_experiment(str(path), ["swiglu.hiden_dim_multiple_of=8"])
    problems = info.value.problems
    for key, suggestion in {"rope.thta": "'theta'", "rope.scalng": "'scaling'", "model.dimm": "'dim'"}.items():
        line = next(p for p in problems if f"'{key}'" in p)
        assert f"(did you mean {suggestion}?)" in line, line
    assert len(problems) == 4 and any("swiglu.hiden_dim_multiple_of" in p for p in problems), problems
