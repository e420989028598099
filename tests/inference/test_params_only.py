"""Parameters only where only parameters are needed: loading reads `{"params"}` of a train state,
`save_model` (an import) writes parameters only, and training resumes from such a checkpoint
with a fresh optimizer state, computing what a fresh run from the same parameters computes."""

import json

import jax
import numpy as np
import pytest

from axcore.checkpoint import CheckpointError
from axcore.cli import main
from axcore.experiment import load_experiment
from axcore.inference.run_loading import load_model, save_model
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.callbacks import Sample
from axcore.trainer.trainer import Trainer

SETTINGS = [*TINY_OVERRIDES, "trainer.max_steps=3", "trainer.checkpoint.every_n_steps=3", "trainer.eval_every=0",
            "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]", "trainer.log_every=1",
            "mesh.instance_type=cpu-1"]


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _index_paths(step_dir):
    """The tree paths an orbax step holds (its `meta` item's index)."""
    return sorted(e["path"] for e in json.loads((step_dir / "meta" / "metadata").read_text())["index"])


def _params_only_run(tmp_path, name, params=None):
    """A run directory written by `save_model` (as an import is) -> (run, the params saved)."""
    run = tmp_path / name
    exp = load_experiment(None, [*SETTINGS, f"trainer.run_dir={run}"])
    if params is None:  # What the trainer's own init draws from trainer.seed.
        model = exp.config.model.instantiate(name="model", registries=exp.registries)
        params = model.initialize(jax.random.key(exp.config.trainer.seed))
    save_model(exp, params, run)
    return run, params


def test_save_model_writes_parameters_only(tmp_path):
    run, params = _params_only_run(tmp_path, "saved")
    want = sorted("['params']" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
    assert _index_paths(run / "checkpoints" / "0") == want  # No opt_state, step or prng_key.
    meta = json.loads((run / "checkpoints" / "0" / "meta" / "metadata").read_text())["metadata"]
    assert meta == {"params_only": True, "step": 0, "seed": 0, "input": None}
    loaded = load_model(run)
    assert loaded.step == 0
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loading_a_train_run_does_not_read_the_optimizer_state(tmp_path, monkeypatch):
    run = tmp_path / "run"
    final = {}
    original = Sample.on_run_end

    def capture(self, run):  # The final parameters, no sample.
        final["params"] = jax.device_get(run.state["params"])

    monkeypatch.setattr(Sample, "on_run_end", capture)
    overrides = [*SETTINGS, "trainer.checkpoint.backend=tensorstore", f"trainer.run_dir={run}"]
    assert main(["train", *_sets(overrides)]) == 0
    monkeypatch.setattr(Sample, "on_run_end", original)
    step = run / "checkpoints" / "step_00000003"
    moments = [p for p in (step / "arrays").glob("opt_state*/c/**/*") if p.is_file()]
    assert moments
    for chunk in moments:  # Every optimizer-state chunk zeroed: a full restore cannot pass its checksums.
        chunk.write_bytes(b"\0" * chunk.stat().st_size)
    reports = []
    loaded = load_model(run, report=reports.append)
    assert loaded.step == 3 and reports == []  # Step 3 verified: only its parameters were read.
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(final["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    exp = load_experiment(run / "config.yaml")
    backend = exp.registries.checkpoint_backends["tensorstore"](run / "checkpoints")
    try:
        with pytest.raises(CheckpointError, match=r"\['opt_state'\].*checksum"):
            backend.restore(Trainer(exp).step.abstract_state(), 3)
    finally:
        backend.close()


def test_training_resumes_from_parameters_only_like_a_fresh_run(tmp_path, capsys):
    # The reference: a fresh run, whose init draws the same parameters from trainer.seed.
    fresh = tmp_path / "fresh"
    assert main(["train", *_sets([*SETTINGS, f"trainer.run_dir={fresh}"])]) == 0
    capsys.readouterr()
    run, params = _params_only_run(tmp_path, "imported")
    assert main(["train", str(run / "config.yaml")]) == 0
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("Resumed")]
    assert len(line) == 1 and line[0].startswith(f"Resumed from step 0 in {run} (parameters only, optimizer state "
                                                 f"initialized; restored in ")
    want, got = _losses(fresh), _losses(run)
    assert sorted(got) == [1, 2, 3] and sorted(want) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)], rtol=1e-6)
    # The saved step is a full train state again, and resuming it is an ordinary resume.
    paths = _index_paths(run / "checkpoints" / "3")
    assert {p.split("]")[0] + "]" for p in paths} == {"['params']", "['opt_state']", "['step']", "['prng_key']"}
    assert main(["train", str(run / "config.yaml"), *_sets(["trainer.max_steps=4"])]) == 0
    err = capsys.readouterr().err
    assert f"Resumed from step 3 in {run} (restored in " in err and "parameters only" not in err
    # Other parameters give other losses: the run above did start from the checkpoint's parameters.
    rng = np.random.default_rng(0)
    moved = jax.tree.map(lambda p: np.asarray(p) + 0.05 * rng.standard_normal(p.shape).astype(p.dtype), params)
    other, _ = _params_only_run(tmp_path, "other", moved)
    assert main(["train", str(other / "config.yaml")]) == 0
    assert abs(_losses(other)[1] - want[1]) > 1e-3


def test_parameters_only_checkpoint_of_another_model_is_one_line(tmp_path, capsys):
    run, _ = _params_only_run(tmp_path, "imported")
    saved = (run / "config.yaml").read_bytes()
    assert main(["train", str(run / "config.yaml"), *_sets(["model.dim=48"])]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]  # The saved config says so before anything runs.
    assert message.startswith(f"axcore: error: Run directory '{run}' holds another run (model.dim: saved 32 vs now 48")
    assert (run / "config.yaml").read_bytes() == saved
    # Without a saved config to compare with, restoring finds it: the parameters' error.
    config = tmp_path / "config.yaml"
    (run / "config.yaml").rename(config)
    assert main(["train", str(config), *_sets([f"trainer.run_dir={run}", "model.dim=48"])]) == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert "Traceback" not in err and message.startswith("axcore: error: ")
    assert "another model: ['params']" in message and "(checkpoint float32[32], target float32[48])" in message
    assert "opt_state" not in message  # The parameters' error, not the full train state's.
