"""The input iterator's position travels with a checkpoint and resumes exactly."""

import jax.numpy as jnp
import numpy as np
import pytest

from axcore.data import InputConfig, Split, TextFiles
from axcore.plugins import builtin_registries


@pytest.mark.parametrize("backend", ["orbax", "tensorstore"])
def test_iterator_position_survives_a_checkpoint(tmp_path, backend):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i} of a small corpus.\n" for i in range(30)))
    cfg = InputConfig(source=TextFiles.default_config().set(paths=[str(text)]), batch_size=2, seq_len=16, seed=3)
    original = cfg.make_iterator(Split.TRAIN)
    for _ in range(5):
        next(original)
    store = builtin_registries().checkpoint_backends[backend](tmp_path / "ckpt", async_save=False)
    store.save(5, {"x": jnp.zeros(2)}, {"input": original.state()})
    store.wait()
    expected = [next(original) for _ in range(30)]  # Crosses at least one epoch boundary.

    _, metadata = store.restore({"x": jnp.zeros(2)})
    resumed = cfg.make_iterator(Split.TRAIN)
    resumed.set_state(metadata["input"])
    for want in expected:
        got = next(resumed)
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
        np.testing.assert_array_equal(got["target_labels"], want["target_labels"])
    store.close()
