"""Objectives are registered components: a test plugin adds one (no change to axcore) and trains with it.

The logged loss and metrics of step 1 (the initial parameters on the first batch) are
checked against the objective's formula computed in NumPy from the model's logits; an
objective keeping state (a frozen reference copy of the parameters) gets it sharded,
unchanged by training, saved and resumed with the train state.
"""

import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.data import Split
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.observe.writers import read_jsonl_metrics
from axcore.testing import TINY_OVERRIDES
from axcore.trainer import Objective, ObjectiveOutput
from axcore.trainer.trainer import Trainer

Z_WEIGHT = 0.1
PROXIMAL = 0.5


class WeightedZLoss(Objective):
    """Token-weighted cross-entropy plus `z_weight` x the token-weighted mean of logsumexp(logits)^2."""

    class Config(Objective.Config):
        """Configures WeightedZLoss."""

        # Weight of the z-loss term.
        z_weight: float = Z_WEIGHT

    def loss(self, model, params, batch, *, prng_key, is_training, state=None):
        inputs = {"input_ids": batch["input_ids"], "positions": batch["positions"], "segment_ids": batch["segment_ids"]}
        logits, collection = axcore.functional(model, params, inputs, prng_key, is_training, method="logits")
        labels, weights = jnp.maximum(batch["target_labels"], 0), batch["target_weights"]
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        total = jnp.sum(weights)
        xent = jnp.sum((log_z - picked) * weights) / total
        z = jnp.sum(log_z**2 * weights) / total
        metrics = {"xent": xent, "z": z, "num_tokens": total}
        return ObjectiveOutput(xent + self.config.z_weight * z, metrics, collection)


class Proximal(Objective):
    """The model's own loss plus `PROXIMAL` x the squared distance of the parameters to a frozen reference copy."""

    def init_state(self, params):
        return {"reference": params}

    def loss(self, model, params, batch, *, prng_key, is_training, state=None):
        (loss, metrics), collection = axcore.functional(model, params, (batch,), prng_key, is_training)
        distance = sum(jnp.sum((p - r) ** 2) for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(state["reference"])))
        return ObjectiveOutput(loss + PROXIMAL * distance, {**metrics, "distance": distance}, collection)


class ObjectivesPlugin:
    @axcore.hookimpl
    def axcore_register_objectives(self, register):
        register("weighted_z_loss", WeightedZLoss)
        register("proximal", Proximal)


OBJECTS = {"objectives_test": ObjectivesPlugin()}
RUN = [*TINY_OVERRIDES, "plugins=[objectives_test]", "trainer.log_every=1", "trainer.eval_every=0",
       "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]", "trainer.learner.schedule.warmup_steps=0"]


def _experiment(run_dir, *extra):
    return load_experiment(None, [*RUN, f"trainer.run_dir={run_dir}", *extra], objects=OBJECTS)


def _numpy_xent_z(model, params, batch):
    """Token-weighted cross-entropy and z-loss in float64 NumPy, from the model's logits."""
    inputs = {k: batch[k] for k in ("input_ids", "positions", "segment_ids")}
    logits, _ = axcore.functional(model, params, inputs, None, False, method="logits")
    logits = np.asarray(logits, np.float64)
    labels, weights = np.maximum(batch["target_labels"], 0), np.asarray(batch["target_weights"], np.float64)
    top = logits.max(-1)
    log_z = np.log(np.exp(logits - top[..., None]).sum(-1)) + top
    picked = np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return ((log_z - picked) * weights).sum() / weights.sum(), (log_z**2 * weights).sum() / weights.sum()


def test_a_plugin_objective_trains_and_logs_its_formula(tmp_path):
    exp = _experiment(tmp_path, "trainer.objective.type=weighted_z_loss", "trainer.max_steps=2")
    assert exp.registries.objectives["weighted_z_loss"] is WeightedZLoss
    trainer = Trainer(exp)
    params = jax.device_get(trainer.step.init_state()["params"])  # The run starts from the same seed.
    result = trainer.run()
    records = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    first = next(r for r in records if r["step"] == 1)

    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    xent, z = _numpy_xent_z(trainer.step.model, params, batch)
    np.testing.assert_allclose(first["train/xent"], xent, rtol=1e-5)
    np.testing.assert_allclose(first["train/z"], z, rtol=1e-5)
    np.testing.assert_allclose(first["train/loss"], xent + Z_WEIGHT * z, rtol=1e-5)
    assert z > 1.0 and result.step == 2  # The auxiliary term is not negligible: the test tells the losses apart.


def test_objective_state_is_frozen_sharded_saved_and_resumed(tmp_path):
    exp = _experiment(tmp_path, "trainer.objective.type=proximal", "trainer.max_steps=2",
                      "trainer.checkpoint.every_n_steps=1", "trainer.checkpoint.keep_last_n=null")
    trainer = Trainer(exp)
    initial = jax.device_get(trainer.step.init_state()["params"])
    abstract = trainer.step.abstract_state()
    assert jax.tree.structure(abstract["objective"]["reference"]) == jax.tree.structure(abstract["params"])
    for ref, param in zip(jax.tree.leaves(abstract["objective"]), jax.tree.leaves(abstract["params"])):
        assert ref.sharding == param.sharding
    trainer.run()
    records = {r["step"]: r for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")}
    assert records[1]["train/distance"] == 0.0  # Step 1 sees the reference itself.

    backend = exp.registries.checkpoint_backends["orbax"](tmp_path / "checkpoints")
    after_one, _ = backend.restore(abstract, step=1)
    final, _ = backend.restore(abstract, step=2)
    backend.close()
    for ref, p0 in zip(jax.tree.leaves(final["objective"]["reference"]), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(p0))  # Never differentiated nor updated.
    expected = sum(((np.asarray(p1, np.float64) - np.asarray(p0, np.float64)) ** 2).sum()
                   for p1, p0 in zip(jax.tree.leaves(after_one["params"]), jax.tree.leaves(initial)))
    np.testing.assert_allclose(records[2]["train/distance"], expected, rtol=1e-4)

    # Resumed to step 3: the reference comes back from the checkpoint, so step 3's distance is to the initial params.
    resumed = Trainer(_experiment(tmp_path, "trainer.objective.type=proximal", "trainer.max_steps=3"))
    resumed.run()
    records = {r["step"]: r for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")}
    expected = sum(((np.asarray(p2, np.float64) - np.asarray(p0, np.float64)) ** 2).sum()
                   for p2, p0 in zip(jax.tree.leaves(final["params"]), jax.tree.leaves(initial)))
    np.testing.assert_allclose(records[3]["train/distance"], expected, rtol=1e-4)


def test_a_component_that_is_not_an_objective_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"'trainer\.objective' builds .*not an objective.*next_token"):
        _experiment(tmp_path, "trainer.objective.type=adamw")


def test_the_docs_objective_plugin_computes_its_formula():
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "writing-a-plugin.md").read_text()
    [source] = [b for b in re.findall(r"```python\n(.*?)```", docs, re.S) if b.startswith("# axcore_xent_z.py")]
    plugin = types.ModuleType("axcore_xent_z")
    exec(compile(source, "<docs axcore_xent_z>", "exec"), plugin.__dict__)  # Our own docs' code.
    exp = load_experiment(None, [*TINY_OVERRIDES, "plugins=[xent_z]", "trainer.objective.type=xent_z"],
                          objects={"xent_z": plugin})
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    out = exp.config.trainer.objective.instantiate().loss(model, params, batch, prng_key=None, is_training=False)
    xent, z = _numpy_xent_z(model, params, batch)
    np.testing.assert_allclose([out.metrics["cross_entropy"], out.metrics["z_loss"], out.loss],
                               [xent, z, xent + 0.1 * z], rtol=1e-5)
