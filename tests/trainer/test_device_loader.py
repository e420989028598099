"""DeviceLoader and shard_layout: each process's rows, the state after the consumed batch, errors from the thread."""

import dataclasses
import threading
import time
import types

import jax
import numpy as np
import pytest

from axcore.data import DataError
from axcore.data.device_loader import DeviceLoader, shard_layout
from axcore.data.schema import BATCH_SCHEMA
from axcore.errors import ConfigError

B, T = 4, 8


class CountingPipeline:
    """Batch k holds the value k everywhere; state() is the number of batches produced."""

    def __init__(self, fail_at=None, delay=0.0, rows=B):
        self.produced, self.fail_at, self.delay, self.rows = 0, fail_at, delay, rows
        self.closed = False
        self.threads = set()

    def __next__(self):
        self.threads.add(threading.current_thread().name)
        if self.produced == self.fail_at:
            raise DataError("'x.npy' shard 3 is truncated; re-run axcore prepare.")
        time.sleep(self.delay)
        k = self.produced
        self.produced += 1
        return {f.name: np.full((self.rows, T), k, f.dtype) for f in BATCH_SCHEMA.fields}

    def state(self):
        return {"produced": self.produced}

    def close(self):
        self.closed = True


def _sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def test_each_batch_comes_with_the_state_after_it_not_after_the_prefetched_ones():
    pipeline = CountingPipeline()
    with DeviceLoader(pipeline, _sharding(), (B, T), buffer=2) as loader:
        for k in range(5):
            item = next(loader)
            assert item.state == {"produced": k + 1}
            assert set(item.batch) == set(BATCH_SCHEMA.names)
            for name, array in item.batch.items():
                assert isinstance(array, jax.Array) and array.shape == (B, T) and array.dtype == BATCH_SCHEMA[name].dtype
                assert np.all(np.asarray(array) == k)
        time.sleep(0.2)
        # The thread ran ahead (bounded by the queue), yet the states above are the consumed ones.
        assert 5 < pipeline.produced <= 5 + 2 + 1
    assert pipeline.closed and pipeline.threads == {"axcore-device-loader"}


def test_an_error_in_the_thread_is_raised_by_next_as_the_same_data_error():
    pipeline = CountingPipeline(fail_at=2)
    loader = DeviceLoader(pipeline, _sharding(), (B, T))
    next(loader), next(loader)
    with pytest.raises(DataError, match=r"^'x.npy' shard 3 is truncated; re-run axcore prepare\.$"):
        next(loader)
    loader.close()


def test_a_batch_that_breaks_the_schema_is_a_data_error_naming_the_field():
    pipeline = CountingPipeline(rows=B - 1)
    loader = DeviceLoader(pipeline, _sharding(), (B, T), where="The training batch")
    with pytest.raises(DataError, match=r"The training batch: field 'input_ids' is int32 \[3, 8\]"):
        next(loader)
    loader.close()


def test_take_wait_counts_the_time_the_consumer_waited():
    pipeline = CountingPipeline(delay=0.05)
    with DeviceLoader(pipeline, _sharding(), (B, T)) as loader:
        for _ in range(4):
            next(loader)
        waited = loader.take_wait()
        assert 0.1 < waited < 1.0, waited  # About 4 x 50 ms: the consumer does nothing else.
        assert loader.take_wait() == 0.0
        time.sleep(0.2)  # The queue fills up: the next batches cost no wait.
        next(loader), next(loader)
        assert loader.take_wait() < 0.02


# -- shard_layout on a simulated multi-process sharding -------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    process_index: int
    id: int


def _fake_sharding(processes, devices_per_process, batch_size, order=None):
    """Devices of `processes` processes, each device holding batch_size / (all devices) consecutive rows."""
    n = processes * devices_per_process
    per = batch_size // n
    order = order or list(range(n))
    devices = [FakeDevice(d // devices_per_process, d) for d in range(n)]
    index = {devices[d]: (slice(order.index(d) * per, (order.index(d) + 1) * per), slice(None)) for d in range(n)}
    return types.SimpleNamespace(devices_indices_map=lambda shape: index)


@pytest.mark.parametrize(
    "processes, data_shards, me, expected",
    [
        (2, None, 0, (2, 4, (0,))),  # One shard per process by default.
        (2, None, 1, (2, 4, (1,))),
        (2, 4, 1, (4, 2, (2, 3))),  # More shards than processes: each reads its two.
        (1, 2, 0, (2, 4, (0, 1))),  # One process reading both shards = the two-process global batch.
        (1, None, 0, (1, 8, (0,))),
    ],
)
def test_shard_layout_follows_the_rows_each_process_holds(monkeypatch, processes, data_shards, me, expected):
    monkeypatch.setattr(jax, "process_index", lambda: me)
    layout = shard_layout(_fake_sharding(processes, 2, 8), (8, T), data_shards)
    assert (layout.num_shards, layout.rows_per_shard, layout.shards) == expected
    assert layout.local_rows == len(expected[2]) * expected[1]


def test_shard_layout_refuses_shards_that_do_not_divide(monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with pytest.raises(ConfigError, match=r"^input.batch_size=8 is not a multiple of input.data_shards=3;"):
        shard_layout(_fake_sharding(2, 2, 8), (8, T), 3)
    # One shard for two processes: process 0's rows 0..3 are half a shard.
    with pytest.raises(ConfigError, match=r"^Process 0 holds batch rows 0\.\.3, which are not whole data shards"):
        shard_layout(_fake_sharding(2, 2, 8), (8, T), 1)
