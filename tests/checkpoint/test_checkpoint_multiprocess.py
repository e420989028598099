"""Two local processes (jax.distributed, 4 CPU devices each) save and restore together."""

from pathlib import Path

import pytest

from two_process_job import run_job

WORKER = Path(__file__).with_name("checkpoint_multiprocess_worker.py")
BACKENDS = ["orbax", "tensorstore"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multiprocess")
    by_key, outputs = run_job(WORKER, directory, BACKENDS)
    return by_key, outputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_save_and_restore(results, backend):
    by_key, outputs = results
    for i in range(2):
        assert (i, backend) in by_key, f"process {i} output:\n{outputs[i][-4000:] if i < len(outputs) else ''}"
        assert by_key[(i, backend)] == "OK", f"process {i}: {by_key[(i, backend)]}"
