"""The reliability probe's cases (issue 34): values `axcore config` used to accept, each now refused in one line.

Every case went through `axcore config` with exit 0 (and `axcore train` then trained to
NaN, aborted inside XLA, or failed after compiling); each must now exit 2 with one
`axcore: error:` line that names the offending config path, print nothing on stdout
and no traceback. The in-process cases run `axcore config`; the subprocess ones run
`axcore train` and show that the refusal comes before anything is compiled.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import axcore
from axcore import cli
from axcore.data import ByteTokenizer
from axcore.testing import TINY_OVERRIDES, host_devices_env

# (override(s), the line's start after "axcore: error: "): one case of the probe each.
CASES = [
    (["trainer.learner.learning_rate=1e308"],
     "'trainer.learner.learning_rate' must be > 0 and <= 10, got 1e+308; typical peak learning rates"),
    (["trainer.learner.learning_rate=1e-400"],
     "'trainer.learner.learning_rate' must be > 0 and <= 10, got 0.0; typical peak learning rates lie between 1e-5 "
     "and 1e-2 (a literal as small as 1e-400 reads as 0)."),
    (["trainer.learner.learning_rate=10.5"], "'trainer.learner.learning_rate' must be > 0 and <= 10, got 10.5"),
    (["mesh.instance_type=foo"], "'mesh.instance_type' ('foo') names no known platform 'foo'"),
    (["mesh.instance_type=cpu-1", "mesh.mesh_shape=[3]"],
     "'mesh.mesh_shape' [3] needs 3 devices, but instance type 'cpu-1' has 1"),
    (["mesh.instance_type=cpu-4", "mesh.mesh_shape=[3, -1]", "mesh.mesh_axis_names=[data, fsdp]"],
     "'mesh.mesh_shape' [3, -1] needs a multiple of 3 devices, but instance type 'cpu-4' has 4"),
    (["trainer.watchdog.step_timeout_s=0"],
     "'trainer.watchdog.step_timeout_s' must be > 0, got 0.0; null turns the watchdog off."),
    (["trainer.sample.num_tokens=100000000000"], "'trainer.sample.num_tokens' must be an integer from 0 to 65536"),
    (["trainer.eval_batches=1000000"], "'trainer.eval_batches' must be an integer from 0 to 65536"),
    (["input.mixture=[]"], "input.mixture is empty"),
    (["input.mixture=[{name: a}]"], "input.mixture[0] has no source"),
    (["input.mixture=[{name: a, source: {type: embedded_corpus}}, {name: a, source: {type: embedded_corpus}}]"],
     "input.mixture[1].name 'a' repeats input.mixture[0]"),
    (["input.mixture=[{name: '', source: {type: embedded_corpus}}]"], "input.mixture[0].name '' must be non-empty"),
]


def _refused(capsys, argv, start, objects=None):
    assert cli.main(argv, objects=objects) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"axcore: error: {start}"), err
    return lines[0]


@pytest.mark.parametrize("overrides, start", CASES, ids=[" ".join(o)[:60] for o, _ in CASES])
def test_config_refuses_the_probes_case_in_one_line(overrides, start, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["config", "default", *[a for o in overrides for a in ("--set", o)]], start)
    assert os.listdir(tmp_path) == []


def test_a_learning_rate_above_one_is_warned_about_and_accepted(capsys, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "default", "--set", "trainer.learner.learning_rate=2"]) == 0
    assert "trainer.learner.learning_rate: 2.0" in capsys.readouterr().out
    assert "'trainer.learner.learning_rate' is 2, above 1; such a run usually diverges" in caplog.text


class FakeTokenizer(ByteTokenizer):
    """A tokenizer registered by a plugin that the experiment does not list."""


class FakeTokenizerPlugin:
    @axcore.hookimpl
    def axcore_register_tokenizers(self, register):
        register("fake_tokenizer", FakeTokenizer)


def test_an_unknown_component_names_its_path_its_family_and_the_plugin_to_add(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    objects = {"faketok": FakeTokenizerPlugin()}
    line = _refused(capsys, ["config", "default", "--set", "tokenizer={type: fake_tokenizer}"],
                    "'tokenizer.type': no tokenizer named 'fake_tokenizer'; tokenizers: bytes.", objects)
    assert line.endswith("registers it: add `faketok` to plugins:.")  # Only the tokenizers, and who has it.
    line = _refused(capsys, ["config", "default", "--set", "model.decoder.layer.norm.type=nonexistent_norm"],
                    "'model.decoder.layer.norm.type': no layer named 'nonexistent_norm'; layers: ")
    assert "adamw" not in line and "No installed plugin registers it" in line
    # Listed, it is found.
    assert cli.main(["config", "default", "--set", "plugins=[faketok]", "--set", "tokenizer={type: fake_tokenizer}"],
                    objects=objects) == 0


def _axcore(cwd, *argv, env=None):
    return subprocess.run(
        [sys.executable, "-m", "axcore.cli", *argv], capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


@pytest.mark.parametrize(
    "override, start",
    [
        ("trainer.learner.learning_rate=1e308", "'trainer.learner.learning_rate' must be > 0 and <= 10"),
        ("input.source={type: text_files, paths: [missing.txt]}", "input.source.paths[0]"),
    ],
)
def test_train_refuses_before_compiling(override, start, tmp_path):
    """Today the first trains to a NaN loss and exits 0; the second fails only after compiling (15 s)."""
    sets = [a for o in [*TINY_OVERRIDES, "trainer.max_steps=2", override] for a in ("--set", o)]
    out = _axcore(tmp_path, "train", "default", *sets)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "Compiled" not in out.stderr + out.stdout
    assert lines[-1].startswith(f"axcore: error: {start}"), out.stderr
    assert os.listdir(tmp_path) == []  # No run directory.


# The pipeline: 8 host devices, mesh stage x fsdp x data = 2 x 2 x 2, 8 rows, GPipe.
PIPELINE = ["mesh.mesh_shape=[2,2,2]", "mesh.mesh_axis_names=[stage,fsdp,data]", "input.batch_size=8"]
EIGHT_DEVICES = {"XLA_FLAGS": host_devices_env(8)["XLA_FLAGS"]}


def _pipeline_sets(*extra):
    return [a for o in [*PIPELINE, *extra] for a in ("--set", o)]


def _rows_per_device(batch, accumulation, batch_axes):
    """Rows each device holds per step: the batch over gradient accumulation and over the batch's mesh axes."""
    return batch // accumulation // batch_axes


def test_pipeline_microbatches_must_divide_each_devices_rows(tmp_path, capsys, monkeypatch):
    """Today `axcore train` aborts inside XLA's SPMD partitioner (exit 134); microbatches dividing the rows train."""
    rows = _rows_per_device(8, 1, 2 * 2)  # Batch axes: data and fsdp (the default rules), 2 each.
    out = _axcore(tmp_path, "train", "scan", *_pipeline_sets("model.decoder.pipeline={type: gpipe, microbatches: 4}",
                                                             "trainer.max_steps=1"), env=EIGHT_DEVICES)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr and "Compiled" not in out.stderr, out.stderr
    assert lines[-1] == (
        f"axcore: error: 'model.decoder.pipeline.microbatches' (4) does not divide the {rows} rows each device holds "
        f"per step (input.batch_size 8 / trainer.microbatches 1 / batch axes data=2 x fsdp=2); use a divisor of "
        f"{rows}, or a batch size that is a multiple of 16."
    )
    # The same checks at `axcore config` time, for the instance type's 8 devices (none needed here).
    monkeypatch.chdir(tmp_path)
    config = ["config", "scan", "--set", "mesh.instance_type=cpu-8"]
    # Gradient accumulation cuts the rows first: 2 pipeline microbatches of 8 / 2 / 4 = 1 row cannot be.
    assert cli.main([*config, *_pipeline_sets("model.decoder.pipeline={type: gpipe, microbatches: 2}",
                                              "trainer.microbatches=2")]) == 2
    assert f"does not divide the {_rows_per_device(8, 2, 4)} rows" in capsys.readouterr().err
    # What trains: 2 microbatches of the 2 rows, or batch axes of 2 devices (a tensor axis instead of data).
    for extra in (["model.decoder.pipeline={type: gpipe, microbatches: 2}"],
                  ["model.decoder.pipeline={type: gpipe, microbatches: 4}", "mesh.mesh_axis_names=[stage,fsdp,tensor]"]):
        assert cli.main([*config, *_pipeline_sets(*extra)]) == 0, capsys.readouterr().err
    # A pipeline's units must split into the stages: 3 layers over 2 stages cannot.
    assert cli.main([*config, *_pipeline_sets("model.decoder.pipeline={type: gpipe, microbatches: 2}",
                                              "model.num_layers=3")]) == 2
    assert "'model.decoder.pipeline': the 3 stacked units do not split into 2 stages" in capsys.readouterr().err


def test_a_quoted_glob_names_its_one_run_or_is_refused(tmp_path):
    from axcore.cli.common import one_run

    def args(run):
        return type("Args", (), {"run": str(tmp_path / run), "more_runs": [], "command": "generate"})()

    (tmp_path / "mix-1").mkdir()
    assert one_run(args("mix-*")) == str(tmp_path / "mix-1")  # One match: that run.
    (tmp_path / "mix-2").mkdir()
    several = _axcore(tmp_path, "generate", "mix-*", "--prompt", "a")
    assert several.returncode == 2 and several.stderr.strip().splitlines() == [
        f"axcore: error: 2 run directories given (mix-1, mix-2); axcore generate reads one: name one, e.g. the newest: "
        f"{max(['mix-1', 'mix-2'], key=lambda p: ((tmp_path / p).stat().st_mtime, p))}"
    ]
    none = _axcore(tmp_path, "eval", "runs/nothing-*")
    assert none.returncode == 2 and none.stderr.strip().splitlines() == [
        "axcore: error: 'runs/nothing-*' matches no run directory; give a run directory, its checkpoints/ or one "
        "step's directory."
    ]
    assert sorted(p.name for p in pathlib.Path(tmp_path).iterdir()) == ["mix-1", "mix-2"]
