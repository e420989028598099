"""Decoding under a (data, fsdp, tensor) mesh of 8 host devices: the engine's greedy tokens
equal those on one device, and the layers' dense KV cache (`extend`) is laid out on the
training activations' logical axes (batch over data and fsdp, kv_heads over tensor, as the
default rules map them)."""

import pathlib

import pytest

from axcore.testing import run_host_device_worker

WORKER = pathlib.Path(__file__).parent / "sharded_decoding_worker.py"


@pytest.fixture(scope="module")
def results():
    return run_host_device_worker(WORKER, timeout=300)


def test_sharded_greedy_decoding_matches_one_device(results):
    assert results["sharded"] == results["one_device"]
    assert [len(t) for t in results["sharded"]] == [8] * 4


def test_kv_cache_is_sharded_like_the_training_keys(results):
    assert results["cache_shape"] == [4, 16, 2, 8]  # [batch, max_len, kv_heads, head_dim]
    specs = results["cache_specs"]
    assert len(specs) == 4 and all(k.endswith(("['key']", "['value']")) for k in specs), specs
    for spec in specs.values():
        # Trailing unsharded dimensions may be left out of a PartitionSpec.
        assert spec[:3] == [["data", "fsdp"], None, "tensor"], specs
