"""The training loop end to end on a tiny model: artifacts, resume, non-finite loss."""

import re

import jax
import numpy as np
import pytest
import yaml

from axcore.checkpoint import CheckpointNotFoundError  # noqa: F401  (the backend's error types exist)
from axcore.experiment import load_experiment
from axcore.observe import read_jsonl_metrics
from axcore.trainer.trainer import NonFiniteLossError, Trainer
import tiny

TINY = [*tiny.TINY, "trainer.eval_batches=2", "trainer.sample.num_bytes=8", "trainer.learner.warmup_steps=2"]


def _run(run_dir, *extra, stream=None):
    exp = load_experiment(None, [*TINY, f"trainer.run_dir={run_dir}", *extra])
    return Trainer(exp, stream=stream).run()


def _params(run_dir, backend, *extra):
    exp = load_experiment(None, [*TINY, f"trainer.run_dir={run_dir}", f"trainer.checkpoint.backend={backend}", *extra])
    trainer = Trainer(exp)
    factory = exp.registries.checkpoint_backends[backend]
    store = factory(run_dir / "checkpoints")
    state, metadata = store.restore(trainer.abstract_state())
    store.close()
    return jax.device_get(state["params"]), metadata


def test_training_writes_every_artifact_and_loss_falls(tmp_path, capsys):
    run = tmp_path / "run"
    result = _run(run, "trainer.max_steps=30", "trainer.eval_every=15", "trainer.checkpoint.every_n_steps=10")
    assert result.step == 30
    records = read_jsonl_metrics(run / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 30 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 2 and result.eval_loss == pytest.approx(evals[-1])
    assert {"train/grad_norm", "train/learning_rate", "train/tokens_per_sec", "train/aux_loss"} <= set(records[-1])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["dim"] == 32 and saved["trainer"]["max_steps"] == 30
    assert "model.dim: 32" in (run / "config.txt").read_text()
    assert result.sample.startswith("The ") and len(result.sample.encode()) >= 4 + 8 - 3
    assert "Sample:" in capsys.readouterr().out
    _, metadata = _params(run, "orbax")
    assert metadata["step"] == 30 and set(metadata["input"]) == {"epoch", "position"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["orbax", "tensorstore"])
def test_resume_is_bit_identical(tmp_path, backend):
    common = [f"trainer.checkpoint.backend={backend}", "trainer.eval_every=0", "trainer.sample.num_bytes=0",
              "trainer.checkpoint.every_n_steps=20", "model.decoder.layer.dropout_rate=0.1",
              "trainer.learner.decay_steps=40"]  # The same schedule whether the run stops at 20 or 40.
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(straight, "trainer.max_steps=40", *common)
    _run(split, "trainer.max_steps=20", *common)
    resumed = _run(split, "trainer.max_steps=40", *common)
    assert resumed.step == 40
    a, meta_a = _params(straight, backend)
    b, meta_b = _params(split, backend)
    assert meta_a == meta_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    steps = [r["step"] for r in read_jsonl_metrics(split / "metrics.jsonl")]
    assert steps == list(range(1, 41))  # The resumed run continued the same log.


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    diverging = ["trainer.learner.learning_rate=1e30", "trainer.learner.max_grad_norm=null"]
    with pytest.raises(NonFiniteLossError, match=r"diverged at step (\d+).*last good checkpoint is step") as info:
        _run(run, "trainer.max_steps=50", *diverging, "trainer.checkpoint.every_n_steps=1",
             "trainer.learner.warmup_steps=0", "trainer.eval_every=0")
    bad_step = int(re.search(r"at step (\d+)", str(info.value)).group(1))
    params, metadata = _params(run, "orbax", *diverging)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    assert metadata["step"] == bad_step - 1
