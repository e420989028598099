"""The input pipeline's state travels with a checkpoint and resumes exactly: packed rows, a mixture, data shards."""

import jax.numpy as jnp
import numpy as np
import pytest

from axcore.data import (
    BATCH_SCHEMA,
    DataError,
    EmbeddedCorpus,
    InputConfig,
    MixtureComponent,
    Packing,
    Split,
    TextFiles,
)
from axcore.data.device_loader import ShardLayout
from axcore.experiment.builtins import builtin_registries
from axcore.placement.inputs import merge_input_states, restore_input_state


def _config(tmp_path):
    text = tmp_path / "notes"
    text.mkdir(exist_ok=True)
    for i in range(12):  # Short documents of varied length: rows pack several of them.
        (text / f"note{i:02d}.txt").write_text("".join(f"note {i}, line {j}.\n" for j in range(1 + i % 5)))
    mixture = [
        MixtureComponent(name="book", weight=3.0, source=EmbeddedCorpus.default_config()),
        MixtureComponent(name="notes", weight=1.0, source=TextFiles.default_config().set(paths=[str(text)])),
    ]
    return InputConfig(mixture=mixture, batch_size=4, seq_len=32, seed=3, packing=Packing.FIRST_FIT)


def _assert_same(got, want):
    for name in BATCH_SCHEMA.names:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("backend", ["orbax", "tensorstore"])
def test_pipeline_state_survives_a_checkpoint_with_packing_and_a_mixture(tmp_path, backend):
    cfg = _config(tmp_path)
    original = cfg.make_pipeline(Split.TRAIN, shards=[0, 1], num_shards=2)
    for _ in range(5):
        next(original)
    store = builtin_registries().checkpoint_backends[backend](tmp_path / "ckpt", async_save=False)
    store.save(5, {"x": jnp.zeros(2)}, {"input": original.state()})
    store.wait()
    expected = [next(original) for _ in range(12)]  # The notes component wraps around its 12 documents.
    original.close()
    assert any(len(np.unique(b["segment_ids"][b["segment_ids"] > 0])) > 1 for b in expected)  # Packed rows.

    _, metadata = store.restore({"x": jnp.zeros(2)})
    resumed = cfg.make_pipeline(Split.TRAIN, shards=[0, 1], num_shards=2)
    restore_input_state(resumed, metadata["input"], ShardLayout(2, 2, (0, 1)), "step 5")
    for want in expected:
        _assert_same(next(resumed), want)
    resumed.close()
    store.close()


def test_two_processes_states_merge_and_resume_in_one_process(tmp_path):
    """Shards 0 and 1 read apart (two processes), their states merged: one process with both continues both."""
    cfg = _config(tmp_path)
    parts = [cfg.make_pipeline(Split.TRAIN, shards=[s], num_shards=2) for s in (0, 1)]
    for part in parts:
        for _ in range(4):
            next(part)
    merged = merge_input_states([part.state() for part in parts])
    assert sorted(merged["shards"]) == ["0", "1"] and merged["num_shards"] == 2
    expected = [[next(part) for part in parts] for _ in range(6)]
    one = cfg.make_pipeline(Split.TRAIN, shards=[0, 1], num_shards=2)
    restore_input_state(one, merged, ShardLayout(2, 2, (0, 1)), "step 4")
    for halves in expected:
        want = {name: np.concatenate([h[name] for h in halves]) for name in BATCH_SCHEMA.names}
        _assert_same(next(one), want)
    for pipeline in [*parts, one]:
        pipeline.close()


def test_another_number_of_data_shards_is_refused_in_one_line(tmp_path):
    cfg = _config(tmp_path)
    saved = cfg.make_pipeline(Split.TRAIN, shards=[0, 1], num_shards=2)
    state = saved.state()
    saved.close()
    other = cfg.make_pipeline(Split.TRAIN)
    with pytest.raises(DataError, match=r"^The checkpoint step 7 cut the batch into 2 data shards, this run into 1; "
                                        r"set input.data_shards=2 .*\.$") as error:
        restore_input_state(other, state, ShardLayout(1, 4, (0,)), "step 7")
    assert "\n" not in str(error.value)
    other.close()
