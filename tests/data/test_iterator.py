"""axcore/data/iterator.py: the endless epoch order, the streamed-document reader's state, the chain."""

import itertools
import json

import grain
import numpy as np
import pytest

from axcore.data import DataError, JsonlFiles, Split
from axcore.data.iterator import ChainDataset, DocumentStream, EpochOrder


def test_epoch_order_reshuffles_every_epoch_with_the_seed():
    docs = np.arange(10, 30)
    order = EpochOrder(docs, seed=3, shuffle=True)
    epochs = [[order[epoch * 20 + j] for j in range(20)] for epoch in range(3)]
    assert all(sorted(e) == list(docs) for e in epochs)  # Each epoch visits every document once.
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(docs)  # Reshuffled, not the file order.
    again = EpochOrder(docs, seed=3, shuffle=True)
    assert [again[i] for i in range(60)] == sum(epochs, [])  # The seed decides the order.
    other = EpochOrder(docs, seed=4, shuffle=True)
    assert [other[i] for i in range(20)] != epochs[0]
    docs = np.array([10, 11, 12, 13, 14])
    assert [EpochOrder(docs, seed=3, shuffle=False)[i] for i in range(7)] == [10, 11, 12, 13, 14, 10, 11]


def test_a_streamed_source_resumes_mid_epoch_from_its_counters(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)))
    source = JsonlFiles.default_config().set(paths=[str(path)]).instantiate()
    stream = DocumentStream(source, Split.TRAIN, shard=1, num_shards=2)
    iterator = iter(stream)
    first = [next(iterator)[1] for _ in range(20)]  # Crosses into the second epoch (14 of 29 train docs per epoch).
    state = json.loads(json.dumps(iterator.get_state()))
    after = [next(iterator)[1] for _ in range(10)]
    train = [f"doc {i}" for i in range(30) if i != 19]  # Document 19 is held out (eval_fraction 0.05).
    assert first + after == list(itertools.islice(itertools.cycle(train[1::2]), 30))
    resumed = iter(stream)
    resumed.set_state(state)
    assert [next(resumed)[1] for _ in range(10)] == after
    with pytest.raises(DataError, match="is not a streamed source's state"):
        resumed.set_state({"epoch": 0})


def test_a_state_past_the_data_is_refused(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    source = JsonlFiles.default_config().set(paths=[str(path)]).instantiate()
    iterator = iter(DocumentStream(source, Split.TRAIN, 0, 1))
    iterator.set_state({"epoch": 0, "read": 9, "taken": 9, "yielded": 9})
    with pytest.raises(DataError, match="has read 9 documents of an epoch, but the data now holds fewer"):
        next(iterator)


def test_chain_reads_its_parents_in_turn_and_resumes():
    chain = ChainDataset([grain.MapDataset.range(3).to_iter_dataset(), grain.MapDataset.range(10, 12).to_iter_dataset()])
    iterator = iter(chain)
    assert [next(iterator) for _ in range(4)] == [0, 1, 2, 10]
    state = iterator.get_state()
    resumed = iter(chain)
    resumed.set_state(state)
    assert list(resumed) == [11]
