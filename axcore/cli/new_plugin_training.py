"""The templates of `axcore new-plugin --kind objective` and `--kind data_source` (see `axcore.cli.new_plugin`).

Each kind is `(summary, usage, plugin module, tests)`, `string.Template`s over the
fields `new_plugin` fills (`$name`, `$package`, `$Class`, ...). Each module is a
working example to replace: label-smoothed cross-entropy for an objective, arithmetic
exercises made up from a seed for a data source; each test module checks it against a
formula computed in the test (NumPy, or the text's own arithmetic) and trains with it.
"""

from __future__ import annotations

OBJECTIVE_PLUGIN = '''\
"""The `$name` plugin: a training objective, chosen with `trainer.objective: {type: $name}`.

The code below is a working example to replace: label-smoothed cross-entropy (each
target keeps 1 - smoothing of its probability mass; smoothing is spread evenly over the
vocabulary). An objective runs the model itself (`axcore.functional`) and returns the
loss the train step differentiates, its metrics (logged as `train/<name>`) and the
model's output collection; the contract is in `axcore.learning.objectives`.

    plugins: [$name]
    trainer:
      objective: {type: $name, smoothing: 0.1}
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp

from axcore import functional, hookimpl
from axcore.config import Probability
from axcore.trainer import Objective, ObjectiveOutput

# The batch fields the model reads (the others are targets).
MODEL_INPUTS = ("input_ids", "positions", "segment_ids")


class ${Class}Objective(Objective):
    """Label-smoothed cross-entropy, weighted by `target_weights`, averaged over the target tokens."""

    class Config(Objective.Config):
        """Configures ${Class}Objective."""

        # Share of each target's probability spread evenly over the vocabulary (0: plain cross-entropy).
        smoothing: Annotated[float, Probability] = 0.1

    def loss(self, model, params, batch, *, prng_key, is_training, state=None):
        """Mean over target tokens of (1 - s) * -log p(label) + s * the mean over the vocabulary of -log p(v)."""
        del state
        inputs = {k: batch[k] for k in MODEL_INPUTS}
        logits, collection = functional(model, params, inputs, prng_key, is_training, method="logits")
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        labels = jnp.maximum(batch["target_labels"], 0)  # Padding's label (-1) has weight 0.
        weights = batch["target_weights"].astype(jnp.float32)
        label_nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
        uniform_nll = -jnp.mean(log_probs, axis=-1)
        smoothing = self.config.smoothing
        tokens = jnp.sum(weights)
        per_token = (1.0 - smoothing) * label_nll + smoothing * uniform_nll
        loss = jnp.sum(per_token * weights) / jnp.maximum(tokens, 1.0)
        metrics = {"cross_entropy": jnp.sum(label_nll * weights) / jnp.maximum(tokens, 1.0), "num_tokens": tokens}
        return ObjectiveOutput(loss, metrics, collection)


@hookimpl
def axcore_register_objectives(register):
    """Registers the objective as `$name`."""
    register("$name", ${Class}Objective)
'''

OBJECTIVE_TESTS = '''\
"""The $name objective against the label-smoothing formula in NumPy, and a few training steps with it."""

import jax
import numpy as np

import axcore
from axcore.data import Split

SMOOTHING = 0.2


def _setup(load, smoothing):
    experiment = load([f"trainer.objective={{type: $name, smoothing: {smoothing}}}"])
    model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
    params = model.initialize(jax.random.key(0))
    batch = next(experiment.config.input.make_iterator(Split.TRAIN))
    return model, params, batch, experiment.config.trainer.objective.instantiate()


def _numpy_loss(model, params, batch, smoothing):
    """Cross-entropy against the smoothed target distribution, float64, from the model's logits."""
    inputs = {k: batch[k] for k in ("input_ids", "positions", "segment_ids")}
    logits = np.asarray(axcore.functional(model, params, inputs, None, False, method="logits")[0], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    vocab = logits.shape[-1]
    labels = np.maximum(np.asarray(batch["target_labels"]), 0)
    weights = np.asarray(batch["target_weights"], np.float64)
    target = np.eye(vocab)[labels] * (1.0 - smoothing) + smoothing / vocab
    return float(np.sum(-(target * log_probs).sum(-1) * weights) / weights.sum())


def test_is_registered(axcore_registries):
    assert "$name" in axcore_registries.objectives


def test_loss_equals_the_formula(axcore_tiny_experiment):
    for smoothing in (0.0, SMOOTHING):
        model, params, batch, objective = _setup(axcore_tiny_experiment, smoothing)
        out = objective.loss(model, params, batch, prng_key=None, is_training=False)
        np.testing.assert_allclose(float(out.loss), _numpy_loss(model, params, batch, smoothing), rtol=1e-5)
        assert float(out.metrics["num_tokens"]) == float(np.sum(batch["target_weights"]))


def test_training_lowers_the_loss(axcore_tiny_experiment):
    model, params, batch, objective = _setup(axcore_tiny_experiment, SMOOTHING)

    @jax.jit
    def step(p):
        loss, grads = jax.value_and_grad(
            lambda q: objective.loss(model, q, batch, prng_key=None, is_training=False).loss
        )(p)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads), loss

    losses = []
    for _ in range(4):
        params, loss = step(params)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
'''

SOURCE_PLUGIN = '''\
"""The `$name` plugin: a data source, chosen with `input.source: {type: $name}`.

The code below is a working example to replace: arithmetic exercises made up from a
seed (document k holds `lines` lines "a + b = c", drawn with seed k), a random-access
source (`num_documents` and `document(index)`). A source yields documents, never
batches: the input pipeline splits them into train and eval (`eval_fraction`, the rule
in `axcore.data.sources`), shuffles, packs and batches them (docs/data.md, "Sources").
A source that can only be read front to back subclasses `StreamedSource` instead.

    plugins: [$name]
    input:
      source: {type: $name, documents: 256}
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np

from axcore import hookimpl
from axcore.config import Positive
from axcore.data import RandomAccessSource

# Operands are drawn from 0 .. MAX_OPERAND - 1.
MAX_OPERAND = 1000


def exercise_text(index: int, lines: int) -> str:
    """Document `index`'s text: `lines` lines "a + b = c", the operands drawn with seed `index`."""
    operands = np.random.default_rng(index).integers(0, MAX_OPERAND, size=(lines, 2))
    return "".join(f"{a} + {b} = {a + b}\\n" for a, b in operands.tolist())


class ${Class}Source(RandomAccessSource):
    """Arithmetic exercises, `documents` documents of `lines` lines each, tokenized with the experiment's tokenizer."""

    class Config(RandomAccessSource.Config):
        """Configures ${Class}Source."""

        # Documents in all (both splits).
        documents: Annotated[int, Positive] = 256
        # Lines "a + b = c" per document.
        lines: Annotated[int, Positive] = 16

    def num_documents(self) -> int:
        return self.config.documents

    def document(self, index: int) -> dict[str, Any]:
        """`{"tokens": int32 [n], "location": str}` of document `index` (0 .. documents - 1)."""
        if not 0 <= index < self.config.documents:
            raise IndexError(f"document {index} out of range 0..{self.config.documents - 1}")
        return {"tokens": self.encode(exercise_text(index, self.config.lines)), "location": f"$name document {index}"}

    def describe(self) -> str:
        return f"$name ({self.config.documents} documents)"


@hookimpl
def axcore_register_data_sources(register):
    """Registers the source as `$name`."""
    register("$name", ${Class}Source)
'''

SOURCE_TESTS = '''\
"""The $name source: documents whose arithmetic holds, the held-out rule, and training on it."""

import math

import numpy as np

from axcore.data import Split

SOURCE = "input.source={type: $name, documents: 40, lines: 4}"


def _source(load):
    return load([SOURCE]).config.input.source.instantiate()


def test_is_registered(axcore_registries):
    assert "$name" in axcore_registries.data_sources


def test_documents_hold_correct_sums(axcore_tiny_experiment):
    source = _source(axcore_tiny_experiment)
    assert source.num_documents() == 40
    texts = []
    for index in range(source.num_documents()):
        document = source.document(index)
        assert document["tokens"].dtype == np.int32 and document["tokens"].ndim == 1
        text = bytes(document["tokens"].astype(np.uint8)).decode()  # No tokenizer given: one token per byte.
        lines = text.splitlines()
        assert len(lines) == 4
        for line in lines:
            a, plus, b, equals, c = line.split()
            assert (plus, equals) == ("+", "=") and int(a) + int(b) == int(c)
        texts.append(text)
    assert len(set(texts)) == len(texts)  # Every document differs.
    assert source.document(7)["tokens"].tolist() == source.document(7)["tokens"].tolist()


def test_held_out_documents_follow_the_rule(axcore_tiny_experiment):
    source = _source(axcore_tiny_experiment)
    fraction = source.config.eval_fraction
    held_out = [k for k in range(40) if math.floor((k + 1) * fraction) > math.floor(k * fraction)]
    assert source.split_indices(Split.EVAL).tolist() == held_out
    assert sorted(source.split_indices(Split.TRAIN).tolist() + held_out) == list(range(40))


def test_trains(axcore_tiny_experiment, axcore_train_steps):
    losses = axcore_train_steps(axcore_tiny_experiment([SOURCE]), steps=3)
    assert losses[-1] < losses[0]
'''

TRAINING_PLUGINS = {
    "objective": (
        "$Title: an axcore objective plugin (TODO: say what it does, in one line).",
        "axcore train --set plugins=[$name] --set 'trainer.objective={type: $name, smoothing: 0.1}'",
        OBJECTIVE_PLUGIN,
        OBJECTIVE_TESTS,
    ),
    "data_source": (
        "$Title: an axcore data source plugin (TODO: say what it does, in one line).",
        "axcore train --set plugins=[$name] --set 'input.source={type: $name}'",
        SOURCE_PLUGIN,
        SOURCE_TESTS,
    ),
}
