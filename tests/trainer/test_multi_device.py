"""Training on 8 (host-platform) devices matches one device; the (data, fsdp, tensor) layout follows the rules.

All 8-device work runs in one subprocess (`multi_device_worker.py`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`: this process's JAX already has
its devices), shared by the tests below through a module fixture.
"""

import pathlib

import pytest

from axcore.testing import run_host_device_worker

WORKER = pathlib.Path(__file__).parent / "multi_device_worker.py"
# Relative loss difference allowed at every one of the 20 steps (float32; measured ~2e-7).
RTOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_host_device_worker(WORKER, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["data2_fsdp2_tensor2", "fsdp2_sequence4", "fsdp2_sequence4_chunked_loss", "moe_data2_fsdp2_expert2",
     "moe_batch_over_data_expert"],
)
def test_loss_matches_single_device_every_step(results, name):
    run = results["runs"][name]
    reference = results["runs"][run["reference"]]["losses"]
    assert len(run["losses"]) == len(reference) == 20
    for step, (got, want) in enumerate(zip(run["losses"], reference), 1):
        assert abs(got - want) <= RTOL * abs(want), f"{name} step {step}: {got} vs single-device {want}"
    assert reference[-1] < reference[0] - 1.0  # It trained.


@pytest.mark.slow
def test_data_fsdp_tensor_layout_follows_the_rules(results):
    layout = results["layout"]
    assert layout["param_mismatches"] == []
    assert layout["opt_mismatches"] == []
    # Adam's two moments per parameter are sharded like it; the rest are scalar counts.
    assert layout["opt_like_params"] == 2 * layout["num_params"]
    assert layout["opt_other"] and all(entry.endswith(" []") for entry in layout["opt_other"])
    # The batch [4, 32] is split over data and fsdp (4 ways), the same rows on both tensor shards.
    assert layout["batch_spec"] == "P(('data', 'fsdp'),)"
    assert layout["batch_shard_shape"] == [1, 32] and layout["batch_rows_by_coords_ok"]
    # Per-device bytes: a quarter of everything (fsdp x tensor) plus the replicated leaves (norm scales,
    # step, key, counts), plus what the position table lacks (its max_len dim has no logical axis: 2-way).
    bound = layout["total_bytes"] / 4 + layout["replicated_bytes"] + layout["position_extra_bytes"]
    assert layout["per_device_bytes"] <= bound
    assert layout["per_device_bytes"] < layout["total_bytes"] / 3.5
    # The sharding dump (abstract mesh) agrees with the trained state, leaf by leaf and in bytes
    # (the state also holds the step and the PRNG key: 12 bytes).
    assert layout["report_mismatches"] == [] and layout["report_rows"] == layout["num_params"]
    assert layout["report_state_bytes_per_device"] + 12 == layout["per_device_bytes"]
