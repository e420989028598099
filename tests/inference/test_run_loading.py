"""`axcore.inference.run_loading`: a run directory made by `axcore train` loads back to the run's final parameters,
through either checkpoint backend, from the run, checkpoints/ or step directory; bad paths and steps
are one-line RunLoadErrors; `save_model` writes a run directory that loads back."""

import dataclasses

import jax
import numpy as np
import pytest

from axcore.checkpoint import CheckpointError
from axcore.cli import main
from axcore.experiment import load_experiment
from axcore.inference.run_loading import LoadedModel, RunLoadError, load_model, locate_run, save_model
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.callbacks import Sample

TRAIN = [*TINY_OVERRIDES, "trainer.max_steps=4", "trainer.checkpoint.every_n_steps=2", "trainer.checkpoint.keep_last_n=null",
         "trainer.eval_every=0", "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]"]


def _train(run_dir, monkeypatch, *extra):
    """Runs `axcore train` in this process; -> the run's final parameters (host copies)."""
    final = {}
    original = Sample.on_run_end

    def capture(self, run):
        final["params"] = jax.device_get(run.state["params"])
        return original(self, run)

    monkeypatch.setattr(Sample, "on_run_end", capture)
    args = ["train"] + [a for o in [*TRAIN, f"trainer.run_dir={run_dir}", *extra] for a in ("--set", o)]
    assert main(args) == 0
    monkeypatch.setattr(Sample, "on_run_end", original)
    return final["params"]


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def orbax_run(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    run = tmp_path_factory.mktemp("orbax") / "run"
    try:
        return run, _train(run, monkeypatch)
    finally:
        monkeypatch.undo()


def test_latest_step_restores_the_runs_final_parameters(orbax_run):
    run, final = orbax_run
    for path in (run, run / "checkpoints", str(run)):
        loaded = load_model(path)
        assert isinstance(loaded, LoadedModel) and loaded.step == 4 and loaded.source == run.resolve()
        _assert_same(loaded.params, final)
    assert loaded.experiment.config.model.dim == 32 and loaded.model.name == "model"
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.step = 1


def test_a_step_directory_or_step_picks_that_step(orbax_run):
    run, final = orbax_run
    by_dir, by_step = load_model(run / "checkpoints" / "2"), load_model(run, step=2)
    assert by_dir.step == by_step.step == 2 and by_dir.source == run.resolve()
    _assert_same(by_dir.params, by_step.params)
    assert not np.array_equal(by_dir.params["embedding"]["weight"], final["embedding"]["weight"])
    # The run's backend parses the name (orbax: the step's digits); locate_run only finds the directory.
    assert locate_run(run / "checkpoints" / "4").step_dir == "4" and load_model(run / "checkpoints" / "4").step == 4


def test_bad_paths_and_steps_are_run_load_errors(orbax_run, tmp_path):
    run, _ = orbax_run
    with pytest.raises(RunLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(RunLoadError, match="holds no config.yaml"):
        load_model(tmp_path)
    with pytest.raises(RunLoadError, match=r"step 3 .*committed steps: 2, 4"):
        load_model(run, step=3)
    with pytest.raises(RunLoadError, match="directory of step 2 but step 4"):
        load_model(run / "checkpoints" / "2", step=4)
    with pytest.raises(RunLoadError, match=r"do not fit the model of its config.yaml .*float32\[32\].*float32\[64\]"):
        load_model(run, overrides=["model.dim=64"])
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text((run / "config.yaml").read_text())
    with pytest.raises(RunLoadError, match="has no checkpoints/ directory"):
        load_model(bare)
    assert not (bare / "checkpoints").exists()  # Nothing created on the way.
    (bare / "checkpoints").mkdir()
    with pytest.raises(RunLoadError, match="No committed checkpoint"):
        load_model(bare)


def test_tensorstore_run_loads_through_its_backend(tmp_path, monkeypatch):
    run = tmp_path / "run"
    final = _train(run, monkeypatch, "trainer.checkpoint.backend=tensorstore")
    loaded = load_model(run)
    assert loaded.step == 4
    _assert_same(loaded.params, final)
    steps = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert load_model(run / "checkpoints" / steps[0]).step == 2


def test_save_model_writes_a_run_that_loads_and_a_params_only_checkpoint_loads(tmp_path):
    exp = load_experiment(None, [*TINY_OVERRIDES, "mesh.instance_type=cpu-1"])
    params = exp.config.model.instantiate(name="model", registries=exp.registries).initialize(jax.random.key(3))
    save_model(exp, params, tmp_path / "saved", step=7)
    loaded = load_model(tmp_path / "saved")
    assert loaded.step == 7
    _assert_same(loaded.params, params)
    with pytest.raises(RunLoadError, match="already holds checkpoints"):
        save_model(exp, params, tmp_path / "saved")
    bad = dict(params, embedding={"weight": np.zeros((3, 32), np.float32)})
    with pytest.raises(RunLoadError, match=r"\['embedding'\]\['weight'\] has shape \(3, 32\)"):
        save_model(exp, bad, tmp_path / "bad")
    # An importer's checkpoint holding only {"params": ...}.
    only = tmp_path / "only"
    exp.save(only)
    backend = exp.registries.checkpoint_backends["orbax"](only / "checkpoints")
    backend.save(0, {"params": params}, {})
    backend.close()
    reports = []
    loaded = load_model(only, report=reports.append)
    assert loaded.step == 0 and reports == []
    _assert_same(loaded.params, params)


def test_corrupt_latest_step_falls_back_and_reports(orbax_run, tmp_path):
    import shutil

    run, _ = orbax_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for f in (copy / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * f.stat().st_size)
    reports = []
    loaded = load_model(copy, report=reports.append)
    assert loaded.step == 2 and len(reports) == 1 and "step 4" in reports[0]
    with pytest.raises(CheckpointError):
        load_model(copy, step=4)
