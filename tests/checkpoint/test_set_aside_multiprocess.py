"""Two local processes (jax.distributed, 4 CPU devices each) set a damaged step aside together.

Both must restore the same older step, name the same moved directory (process 0
renames it; the others wait for the rename), and then save the step afresh.
"""

from pathlib import Path

import pytest

from two_process_job import run_job

WORKER = Path(__file__).with_name("checkpoint_set_aside_worker.py")
BACKENDS = ["orbax", "tensorstore"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("set_aside")
    by_key, outputs = run_job(WORKER, directory, BACKENDS)
    return by_key, outputs, directory


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_processes_set_the_step_aside_and_save_it_again(results, backend):
    by_key, outputs, directory = results
    for i in range(2):
        assert (i, backend) in by_key, f"process {i} output:\n{outputs[i][-4000:] if i < len(outputs) else ''}"
        assert by_key[(i, backend)].startswith("OK "), f"process {i}: {by_key[(i, backend)]}"
    moved = {by_key[(i, backend)].split(" ", 1)[1] for i in range(2)}
    assert len(moved) == 1, moved  # The same name in both processes.
    (name,) = moved
    assert name.startswith(f"{backend}/{'10' if backend == 'orbax' else 'step_00000010'}.corrupt-"), name
    assert (directory / name).is_dir()
