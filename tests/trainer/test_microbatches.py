"""Gradient accumulation (`trainer.microbatches`): splitting each batch into microbatches
computes the full batch's step, up to float32 rounding, and each device keeps its rows."""

import jax
import numpy as np
import pytest

from axcore.data import Split
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

STEPS = 3
# Relative difference of losses and parameters allowed against the whole-batch step (float32 sums
# in another order; measured below 1e-6).
RTOL = 1e-5


def _train(microbatches: int):
    overrides = [*TINY_OVERRIDES, "input.batch_size=8", f"trainer.microbatches={microbatches}", "trainer.max_steps=3"]
    experiment = load_experiment(None, overrides)
    trainer = Trainer(experiment)
    state = trainer.step.init_state()
    step = trainer.step.compiled_train_step()
    batches = experiment.config.input.make_iterator(Split.TRAIN, trainer.step.tokenizer)
    records = []
    for _ in range(STEPS):
        state, metrics = step(state, jax.device_put(next(batches), trainer.step.batch_sharding))
        records.append(jax.device_get(metrics))
    return jax.device_get(state["params"]), records


@pytest.fixture(scope="module")
def whole_batch():
    return _train(1)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_compute_the_whole_batch_step(whole_batch, microbatches):
    params, records = _train(microbatches)
    want_params, want_records = whole_batch
    for got, want in zip(records, want_records):
        assert abs(got["loss"] - want["loss"]) <= RTOL * abs(want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= RTOL * abs(want["grad_norm"])
        assert got["num_tokens"] == want["num_tokens"]  # Summed over the microbatches.
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))


def test_batch_size_must_divide_into_microbatches():
    with pytest.raises(ConfigError, match=r"'input.batch_size' \(8\) must be divisible by 'trainer.microbatches' \(3\)"):
        load_experiment(None, [*TINY_OVERRIDES, "input.batch_size=8", "trainer.microbatches=3"])
