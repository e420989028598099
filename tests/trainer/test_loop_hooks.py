"""A plugin adds loop hooks with no change to axcore: a gradient-norm log every 3 steps and a hook at evaluation.

The logged gradient norms are checked against the norm of gradients computed in plain
JAX from the checkpointed parameters before each logged step (float64 NumPy norm).
"""

import json

import jax
import numpy as np

import axcore
from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.observe import read_jsonl_metrics
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.callbacks import LossPlot, Sample
from axcore.trainer.trainer import Trainer


class GradNormLog:
    """Appends `{"step", "grad_norm"}` of every third step to `<run_dir>/grad_norm.jsonl`."""

    every = 3

    def on_step(self, run):
        with open(run.run_dir / "grad_norm.jsonl", "a") as f:
            f.write(json.dumps({"step": run.step, "grad_norm": float(run.step_metrics["grad_norm"])}) + "\n")


class EvalSeen:
    """Appends the evaluation's loss and the fetched gradient norm at each evaluation to `<run_dir>/eval_hook.jsonl`."""

    def on_eval(self, run):
        line = {"step": run.step, "eval_loss": run.eval.loss, "grad_norm": run.metrics["train/grad_norm"]}
        with open(run.run_dir / "eval_hook.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


class LoopHooksPlugin:
    @axcore.hookimpl
    def axcore_register_loop_hooks(self, register):
        register("grad_norm_log", GradNormLog)
        register("eval_seen", EvalSeen)


RUN = [*TINY_OVERRIDES, "plugins=[loop_hooks_test]", "trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=3",
       "trainer.eval_batches=1", "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]",
       "trainer.checkpoint.every_n_steps=1", "trainer.checkpoint.keep_last_n=null"]


def _numpy_grad_norm(model, params, batch):
    """The global L2 norm (float64) of the gradient of the model's loss on `batch`, by plain `jax.grad`."""
    grads = jax.grad(lambda p: axcore.functional(model, p, (batch,), None, True)[0][0])(params)
    return float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads))))


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_plugin_logs_the_gradient_norm_every_3_steps_and_runs_at_evaluation(tmp_path):
    exp = load_experiment(None, [*RUN, f"trainer.run_dir={tmp_path}"], objects={"loop_hooks_test": LoopHooksPlugin()})
    trainer = Trainer(exp)
    assert [type(c) for c in trainer.callbacks] == [LossPlot, Sample, GradNormLog, EvalSeen]  # After the built-ins.
    trainer.run()

    logged = _lines(tmp_path / "grad_norm.jsonl")
    assert [r["step"] for r in logged] == [3, 6]
    batches = exp.config.input.make_iterator(Split.TRAIN)
    batches = [next(batches) for _ in range(6)]
    backend = exp.registries.checkpoint_backends["orbax"](tmp_path / "checkpoints")
    try:
        abstract = {"params": trainer.step.abstract_state()["params"]}
        expected = {}
        for step in (3, 6):  # The parameters step `step` started from: those saved at step - 1.
            before, _ = backend.restore(abstract, step=step - 1, partial=True)
            expected[step] = _numpy_grad_norm(trainer.step.model, jax.device_get(before["params"]), batches[step - 1])
    finally:
        backend.close()
    for record in logged:
        np.testing.assert_allclose(record["grad_norm"], expected[record["step"]], rtol=1e-4)
    assert expected[3] != expected[6]  # Two different values: the log is of each step, not one repeated.

    evals = _lines(tmp_path / "eval_hook.jsonl")
    assert [r["step"] for r in evals] == [3, 6]
    metrics = {r["step"]: r for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")}
    for record in evals:
        assert record["eval_loss"] == metrics[record["step"]]["eval/loss"]
        np.testing.assert_allclose(record["grad_norm"], expected[record["step"]], rtol=1e-4)
