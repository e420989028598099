"""Tiny experiments and a few training steps, for plugin tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from axcore.data import Split
from axcore.experiment.loading import Experiment, load_experiment
from axcore.module import functional

# Overrides that shrink the built-in experiments (`default`, `scan`) to a model that compiles in seconds.
TINY_OVERRIDES: tuple[str, ...] = (
    "model.dim=32",
    "model.num_layers=2",
    "model.position_embedding.max_len=32",
    "model.decoder.layer.self_attention.num_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=64",
    "input.batch_size=4",
    "input.seq_len=32",
)


def load_tiny_experiment(
    plugins: Sequence[str] = (),
    overrides: Sequence[str] = (),
    *,
    source: str = "default",
    objects: Mapping[str, Any] | None = None,
) -> Experiment:
    """The experiment `source` shrunk by TINY_OVERRIDES, with `plugins:` set to `plugins`, then `overrides`."""
    listed = "plugins=[" + ", ".join(plugins) + "]"
    return load_experiment(source, [*TINY_OVERRIDES, listed, *overrides], objects=dict(objects or {}))


def train_params(
    experiment: Experiment, steps: int = 3, learning_rate: float = 0.1, seed: int = 0
) -> tuple[Any, list[float]]:
    """`steps` plain SGD steps of the experiment's model on its first training batch, from parameters
    initialized with `jax.random.key(seed)`; returns (the final parameter tree, the `steps` losses).

    Raises AssertionError if a loss is not finite.
    """
    model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
    params = model.initialize(jax.random.key(seed))
    batch = next(experiment.config.input.make_iterator(Split.TRAIN))

    def loss_fn(p):
        return functional(model, p, (batch,), None, True)[0][0]

    @jax.jit
    def step(p):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda w, g: w - learning_rate * g, p, grads), loss

    losses = []
    for _ in range(steps):
        params, loss = step(params)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)), f"non-finite training losses: {losses}"
    return params, losses


def train_steps(experiment: Experiment, steps: int = 3, learning_rate: float = 0.1, seed: int = 0) -> list[float]:
    """The losses of `train_params(experiment, steps, learning_rate, seed)`.

    Raises AssertionError if a loss is not finite.
    """
    return train_params(experiment, steps, learning_rate, seed)[1]
