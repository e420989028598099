"""The loop's end-of-run callbacks: the defaults (loss plot, sample) are replaceable, a user's one sees the final state."""

import io

import jax
import numpy as np
import pytest

from axcore.experiment import load_experiment
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.callbacks import LossPlot, Sample
from axcore.trainer.run_dir import FAILED_FILE
from axcore.trainer.trainer import Trainer

RUN = [*TINY_OVERRIDES, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.sample.num_tokens=4",
       "trainer.sample.temperature=0", "trainer.metrics_writers=[{type: jsonl}]", "trainer.learner.schedule.warmup_steps=0"]


class Recorder:
    def __init__(self):
        self.runs = []

    def on_run_end(self, run):
        self.runs.append((run.run_dir, jax.device_get(run.state), dict(run.results)))


def test_callbacks_replace_the_defaults_and_see_the_final_state(tmp_path):
    exp = load_experiment(None, [*RUN, f"trainer.run_dir={tmp_path}"])
    recorder = Recorder()
    trainer = Trainer(exp, callbacks=[recorder])
    result = trainer.run()
    [(seen, state, results)] = recorder.runs
    assert seen == trainer.run_dir and results == {} and int(state["step"]) == 2
    assert result.sample == "" and not (tmp_path / "loss.png").exists()  # Neither default ran.
    backend = exp.registries.checkpoint_backends["orbax"](tmp_path / "checkpoints")
    saved, _ = backend.restore(trainer.step.abstract_state(), step=2)
    backend.close()
    for a, b in zip(jax.tree.leaves(saved["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_default_callbacks_plot_then_sample_and_an_appended_one_runs_last(tmp_path, capsys):
    exp = load_experiment(None, [*RUN, f"trainer.run_dir={tmp_path}"])
    trainer = Trainer(exp)
    assert [type(c) for c in trainer.callbacks] == [LossPlot, Sample]
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    result = trainer.run()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [(_, _, results)] = recorder.runs
    assert results["sample"] == result.sample and result.sample.startswith("The ")
    assert f"Sample:\n{result.sample}" in capsys.readouterr().out


class Stopped(Recorder):
    def on_run_stopped(self, run, error):
        self.runs.append((run.run_dir, error))


class Broken:
    def on_run_stopped(self, run, error):
        raise OSError("disk full")


def test_a_failed_run_keeps_a_loss_plot_of_the_steps_logged_before_it(tmp_path):
    # Steps 1 and 2 are logged and saved; the third step's call fails (as a device error would).
    exp = load_experiment(None, [*RUN, "trainer.max_steps=5", "trainer.log_every=1",
                                 "trainer.checkpoint.every_n_steps=1", f"trainer.run_dir={tmp_path}"])
    stopped = Stopped()
    trainer = Trainer(exp, callbacks=[LossPlot(), Broken(), stopped, Sample()])
    compiled = trainer.step.compiled_train_step

    def failing_train_step():
        step, calls = compiled(), [0]

        def call(state, batch):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("the device went away")
            return step(state, batch)
        call.lower = step.lower
        return call
    trainer.step.compiled_train_step = failing_train_step
    trainer.stream = log = io.StringIO()
    with pytest.raises(RuntimeError, match="the device went away") as raised:
        trainer.run()
    [(seen, got)] = stopped.runs
    assert seen == trainer.run_dir and got is raised.value  # The error the run raised, after a broken callback.
    assert "Broken after the run stopped failed: disk full" in log.getvalue()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / FAILED_FILE).exists()
