"""Property: every bad config ends in one-line AxcoreErrors naming its path, and nothing else.

Hypothesis generates bad experiments from the default experiment's own field
declarations (every leaf, with its annotation and declared range): out-of-range
numbers, NaN and infinities, wrong types, unsafe names and run directories, unknown
fields, components, kernels and plugins, malformed overrides and hostile YAML
values; one to three of them per experiment, mixed with valid overrides, given as
`--set` overrides or as an experiment file. Each goes through `axcore train`
in-process: exit status 2, every stderr line `axcore: error: ...` naming a bad path,
no traceback, no hang (a per-example deadline), no file created.

Across the tests below, at least 1,000 bad configs run in CI (`BAD_CONFIG_EXAMPLES`).
"""

from __future__ import annotations

import enum
import math
import os
import pathlib
import types
import typing

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from axcore import cli
from axcore.config import ConfigBase
from axcore.config.base import DType
from axcore.config.constraints import Floating, Matches, MaxLength, Range, Size, split_constraints
from axcore.experiment import load_experiment

# Bad configs per test; the two tests together run more than 1,000 (the issue's floor).
BAD_CONFIG_EXAMPLES = int(os.environ.get("AXCORE_BAD_CONFIGS", 520))
# Seconds one example may take (a hang fails the test instead of stalling CI).
DEADLINE_MS = 10_000

_DEFAULT = load_experiment("default").config


def _leaves(cfg: ConfigBase, path: str = "") -> list[tuple[str, typing.Any, typing.Any]]:
    """`(path, annotation, value)` of every scalar-typed leaf field of the tree."""
    out = []
    for name, value in cfg.items():
        where = f"{path}.{name}" if path else name
        annotation = type(cfg).field_types()[name]
        if isinstance(value, ConfigBase):
            out += _leaves(value, where)
        elif isinstance(value, list) and value and isinstance(value[0], ConfigBase):
            for i, item in enumerate(value):
                out += _leaves(item, f"{where}[{i}]")
        else:
            out.append((where, annotation, value))
    return out


def _members(annotation):
    """The non-None members of an Optional/Union annotation, constraints kept."""
    base, _ = split_constraints(annotation)
    origin = typing.get_origin(base)
    if origin is typing.Union or origin is types.UnionType:
        return [a for a in typing.get_args(base) if a is not type(None)]
    return [annotation]


def _bad_values(annotation) -> st.SearchStrategy | None:
    """Values that violate the field's type or declared range (None: nothing is bad for it)."""
    members = _members(annotation)
    if len(members) != 1:
        return None
    tp, constraints = split_constraints(members[0])
    wrong_type = st.sampled_from([[1, 2], {"a": 1}, "seven"]) if tp in (int, float) else None
    options = []
    for c in constraints:
        if isinstance(c, Range) and tp in (int, float):
            if c.gt is not None:
                options.append(st.integers(max_value=int(math.floor(c.gt)), min_value=-(10**12)))
            if c.ge is not None:
                options.append(st.integers(max_value=int(math.ceil(c.ge)) - 1, min_value=-(10**12)))
            if c.lt is not None:
                options.append(st.integers(min_value=int(math.ceil(c.lt)), max_value=10**20))
            if c.le is not None:
                options.append(st.integers(min_value=int(math.floor(c.le)) + 1, max_value=10**20))
        if isinstance(c, Size) and tp is int:  # Past either end, up to 2**63 (past int64 too).
            options.append(st.integers(min_value=-(2**63), max_value=c.minimum - 1))
            options.append(st.integers(min_value=c.limit + 1, max_value=2**63))
        if isinstance(c, MaxLength):
            options.append(st.just("r" * (c.limit + 1)))
        if isinstance(c, Matches):
            options.append(st.sampled_from(["../escape", "a/b", "", ".hidden", "x" * 300, "spa ce", "ü"]))
    if tp is int:
        options += [wrong_type, st.floats(allow_nan=False).filter(lambda x: x != int(x) if math.isfinite(x) else True)]
    elif tp is float:
        options += [wrong_type, st.sampled_from([math.nan, math.inf, -math.inf])]
    elif tp is bool:
        options.append(st.sampled_from([2, "maybe", [True]]))
    elif tp is DType:
        options.append(st.sampled_from(["str", "object", "complex64", "<U4", "notadtype", "float33"]))
        if Floating in constraints:
            options.append(st.sampled_from(["int8", "int32", "uint8", "bool"]))
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        options.append(st.sampled_from(["no-such-choice", 3, [1]]))
    elif tp is str and not constraints:
        return None  # Free text (a prompt); names of components are generated separately.
    options = [o for o in options if o is not None]
    return st.one_of(options) if options else None


_FIELDS = [(path, _bad_values(annotation)) for path, annotation, _ in _leaves(_DEFAULT)]
_FIELDS = [(path, strategy) for path, strategy in _FIELDS if strategy is not None]

# Bad overrides that are not a single leaf's value: (override text, the name the error must mention).
_STRUCTURAL = [
    ("model.dimm=3", "dimm"),
    ("trainer.max_step=3", "max_step"),
    ("model.decoder.layer.norm.type=nonexistent_norm", "nonexistent_norm"),
    ("trainer.learner.optimizer.type=linear", "optimizer"),
    ("trainer.checkpoint.backend=zipfile", "zipfile"),
    ("model.kernels={attention: nope}", "model.kernels"),
    ("model.decoder.layer.self_attention.kernel=flashy", "kernel"),
    ("model.remat_policy=save_nothing_at_all", "remat_policy"),
    ("plugins=[no_such_plugin]", "no_such_plugin"),
    ("plugins=[rope>=99]", "rope"),
    ("plugins=[rope, rope]", "rope"),
    ("plugins=7", "plugins"),
    ("model.dim", "model.dim"),
    ("=3", "=3"),
    ("model..dim=3", "model..dim"),
    ("model.decoder.layer.self_attention.num_heads=3", "num_heads"),
    ("model.position_embedding.max_len=16", "max_len"),
    ("trainer.microbatches=3", "microbatches"),
    ("mesh.mesh_shape=[0, 2]", "mesh"),
    ("trainer.run_dir=/proc/self/x", "run_dir"),
    ("trainer.run_dir=''", "run_dir"),
    ("trainer.sample.temperature=.inf", "temperature"),
    ("model.vocab_size=100", "vocab_size"),
    ("input.source.type=token_file", "path"),
    ("trainer.learner.learning_rate=!!python/object/apply:os.system [echo]", "learning_rate"),
    ("model.dim=&a [*a]", "model.dim"),
    # The reliability probe's cases (issue 34), mixed in with the others (those that start a probe process or
    # load every installed plugin, XLA flags and unknown components, are in test_probe_cases.py: per-example deadline).
    ("trainer.learner.learning_rate=1e308", "learning_rate"),
    ("trainer.learner.learning_rate=1e-400", "learning_rate"),
    ("mesh.instance_type=foo", "instance_type"),
    ("mesh.mesh_shape=[15]", "mesh_shape"),
    ("trainer.watchdog.step_timeout_s=0", "step_timeout_s"),
    ("trainer.sample.num_tokens=100000000000", "num_tokens"),
    ("trainer.eval_batches=1000000", "eval_batches"),
    ("input.mixture=[]", "mixture"),
    ("input.mixture=[{name: a}]", "mixture"),
    ("input.mixture=[{name: '', source: {type: embedded_corpus}}]", "mixture"),
    ("model.dim=" + "[" * 200 + "]" * 200, "model.dim"),
]

# Overrides that are fine on their own (mixed in so bad values are not alone).
_GOOD = [
    "model.num_layers=1",
    "model.dim=64",
    "input.batch_size=4",
    "trainer.max_steps=2",
    "trainer.learner.learning_rate=0.01",
    "model.decoder.layer.dropout_rate=0.1",
]


def _format(value) -> str:
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip().removesuffix("\n...").strip()


@st.composite
def bad_experiments(draw):
    """`(overrides, names)`: 1-3 bad overrides (with valid ones mixed in) and the names their errors mention."""
    bad, names = [], []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            path, strategy = draw(st.sampled_from(_FIELDS))
            bad.append(f"{path}={_format(draw(strategy))}")
            names.append(path.rsplit(".", 1)[-1].split("[", 1)[0])
        else:
            text, name = draw(st.sampled_from(_STRUCTURAL))
            bad.append(text)
            names.append(name)
    good = draw(st.lists(st.sampled_from(_GOOD), max_size=2, unique=True))
    # A valid value for a path a bad override sets would replace it (the last --set wins): not a bad experiment.
    good = [g for g in good if g.split("=")[0] not in {b.split("=")[0] for b in bad}]
    overrides = draw(st.permutations(good + bad))
    return list(overrides), names


def _check_failure(capsys, status: int, names: list[str], before: set, cwd: pathlib.Path, label: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, f"{label}: exit {status}, stderr:\n{err}"
    assert lines and all(line.startswith("axcore: error: ") for line in lines), f"{label}: {err}"
    assert "Traceback" not in err, f"{label}: {err}"
    assert any(name in err for name in names), f"{label}: no error names any of {names}:\n{err}"
    assert set(os.listdir(cwd)) == before, f"{label}: created {set(os.listdir(cwd)) - before}"


_SETTINGS = settings(
    max_examples=BAD_CONFIG_EXAMPLES,
    deadline=DEADLINE_MS,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_SETTINGS
@given(bad=bad_experiments())
def test_bad_overrides_fail_in_one_line_each(bad, tmp_path, monkeypatch, capsys):
    overrides, names = bad
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    argv = ["train", "default", *[a for o in overrides for a in ("--set", o)]]
    _check_failure(capsys, cli.main(argv), names, before, tmp_path, f"axcore {' '.join(argv)}")


@_SETTINGS
@given(bad=bad_experiments())
def test_bad_experiment_files_fail_in_one_line_each(bad, tmp_path_factory, monkeypatch, capsys):
    overrides, names = bad
    directory = tmp_path_factory.mktemp("bad")
    lines = []
    for override in overrides:  # The same content as an experiment file, where it nests.
        path, sep, value = override.partition("=")
        if not sep or not path or ".." in path or "[" in path:
            lines.append(f"{override}: 1")  # Malformed as a key too.
            continue
        keys = path.split(".")
        lines.append("".join(f"{k}:\n{'  ' * (i + 1)}" if i < len(keys) - 1 else f"{k}: {value}" for i, k in enumerate(keys)))
    (directory / "exp.yaml").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(directory)
    before = set(os.listdir(directory))
    _check_failure(capsys, cli.main(["train", "exp.yaml"]), names + ["exp.yaml"], before, directory, "\n".join(lines))


def test_the_generator_covers_every_declared_range():
    """Every leaf with a declared range or a checked type gets bad values (nothing silently skipped)."""
    ranged = [p for p, a, v in _leaves(_DEFAULT) if any(split_constraints(m)[1] for m in _members(a))]
    generated = {p for p, _ in _FIELDS}
    assert len(ranged) > 30
    assert set(ranged) <= generated, set(ranged) - generated


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.learner.max_grad_norm=-1", "'trainer.learner.max_grad_norm' must be > 0, got -1.0."),
        ("model.decoder.layer.dropout_rate=1.5", "'model.decoder.layer.dropout_rate' must be >= 0 and < 1, got 1.5."),
        ("trainer.sample.temperature=.nan", "'trainer.sample.temperature' must be a finite number, got nan."),
        ("trainer.eval_every=-1", "'trainer.eval_every' must be >= 0, got -1."),
        ("trainer.log_every=0", "'trainer.log_every' must be > 0, got 0."),
        ("model.dim=0", "'model.dim' must be an integer from 1 to 1048576 ("),
        ("trainer.seed=99999999999999999999", "'trainer.seed' must be >= 0 and < 4.29497e+09"),
        ("model.param_dtype=str", "'model.param_dtype' expects DType or None, got str 'str'."),
        ("model.position_embedding.max_len=100", "'model.position_embedding.max_len' (100) must be >= 'input.seq_len' (256)"),
    ],
)
def test_messages_of_cases_the_issue_found(override, expected, capsys, tmp_path, monkeypatch):
    """The cases the reliability issue reported as accepted or as tracebacks, each with its exact line."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "default", "--set", override]) == 2
    assert expected in capsys.readouterr().err


def test_all_problems_are_reported_in_one_pass(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "default", "--set", "model.dim=0", "--set", "trainer.max_steps=-1", "--set", "name=../up"]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3, lines
    assert {line.split("'")[1] for line in lines} == {"model.dim", "trainer.max_steps", "name"}
    assert os.listdir(tmp_path) == []
