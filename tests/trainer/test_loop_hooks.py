"""A plugin adds loop hooks with no change to axcore: a gradient-norm log every 3 steps and a hook at evaluation.

The logged gradient norms are checked against the norm of gradients computed in plain
JAX from the checkpointed parameters before each logged step (float64 NumPy norm).
"""

import dataclasses
import json

import jax
import numpy as np

import axcore
import axcore.learning.objectives
from axcore.data import BatchField, Split
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


class ScaledLoss(axcore.learning.objectives.Objective):
    """The model's loss times the mean of the batch field `scale`, which it declares (`batch_fields`)."""

    def batch_fields(self):
        return (BatchField("scale", "float32", 0.0, doc="multiplies the loss"),)

    def loss(self, model, params, batch, *, prng_key, is_training, state=None):
        inputs = {k: v for k, v in batch.items() if k != "scale"}
        (loss, metrics), collection = axcore.functional(model, params, (inputs,), prng_key, is_training)
        return axcore.learning.objectives.ObjectiveOutput(loss * batch["scale"].mean(), metrics, collection)


class ScaleBatches:
    """Gives each step the loader's batch plus `scale` = 3 (step 1) or 5, noting the live state's step it saw."""

    def __init__(self):
        self.seen = []

    def next_batch(self, run):
        self.seen.append((run.step, int(run.state["step"])))
        loaded = next(run.loader)
        scale = jax.numpy.full(loaded.batch["input_ids"].shape, 3.0 if run.step == 0 else 5.0)
        return dataclasses.replace(loaded, batch={**loaded.batch, "scale": scale})


class NextBatchPlugin:
    hook = None

    @axcore.hookimpl
    def axcore_register_objectives(self, register):
        register("scaled_loss", ScaledLoss)

    @axcore.hookimpl
    def axcore_register_loop_hooks(self, register):
        register("scale_batches", lambda: NextBatchPlugin.hook)


def test_a_hook_gives_each_step_its_batch_with_a_field_the_objective_declares(tmp_path):
    NextBatchPlugin.hook = hook = ScaleBatches()
    run = [*TINY_OVERRIDES, "plugins=[next_batch_test]", "trainer.objective={type: scaled_loss}", "trainer.max_steps=2",
           "trainer.log_every=1", "trainer.eval_every=0", "trainer.sample.num_tokens=0",
           "trainer.metrics_writers=[{type: jsonl}]", f"trainer.run_dir={tmp_path}"]
    exp = load_experiment(None, run, objects={"next_batch_test": NextBatchPlugin()})
    trainer = Trainer(exp)
    assert trainer.step.abstract_batch()["scale"].shape == (exp.config.input.batch_size, exp.config.input.seq_len)
    trainer.run()
    assert hook.seen == [(0, 0), (1, 1)]  # Before each step, the live state: that of the step before.
    first = next(exp.config.input.make_iterator(Split.TRAIN))
    params = jax.device_get(trainer.step.init_state()["params"])
    (loss, _), _ = axcore.functional(trainer.step.model, params, (first,), None, False)
    logged = {r["step"]: r["train/loss"] for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")}
    np.testing.assert_allclose(logged[1], 3.0 * float(loss), rtol=1e-5)  # Step 1 learned from the hook's batch.
    assert 4.0 * float(loss) < logged[2] < 6.0 * float(loss)  # Step 2's scale, 5, on nearly the same loss.
