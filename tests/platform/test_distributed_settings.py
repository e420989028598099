"""Where a process's multi-process settings come from: flags, AXCORE_* variables, a JobSet, Slurm;
and the address process 0's coordinator service listens on."""

import logging
import socket

import pytest

from axcore.cli import main
from axcore.platform.distributed import (
    DistributedError,
    DistributedSettings,
    coordinator_bind_address,
    distributed_settings,
)

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "node[001-002]",
}
JOBSET = {
    "JOBSET_NAME": "llama",
    "REPLICATED_JOB_NAME": "workers",
    "JOB_INDEX": "0",
    "JOB_COMPLETION_INDEX": "3",
    "AXCORE_NUM_PROCESSES": "4",
}


def test_one_process_needs_nothing():
    assert distributed_settings(environ={}) is None
    assert distributed_settings("127.0.0.1:1234", 1, 0, environ={}) is None
    assert distributed_settings(environ={**SLURM, "SLURM_NTASKS": "1"}) is None


def test_flags_win_over_the_environment():
    settings = distributed_settings("10.0.0.1:8476", 2, 1, environ={**SLURM, **JOBSET})
    assert settings == DistributedSettings("10.0.0.1:8476", 2, 1, "the command line")


def test_axcore_variables():
    environ = {"AXCORE_COORDINATOR_ADDRESS": "host-0:9000", "AXCORE_NUM_PROCESSES": "8", "AXCORE_PROCESS_ID": "5"}
    assert distributed_settings(environ=environ) == DistributedSettings("host-0:9000", 8, 5, "the environment")


def test_jobset_names_the_first_pod_as_coordinator():
    settings = distributed_settings(environ=JOBSET)
    assert settings == DistributedSettings("llama-workers-0-0.llama:8476", 4, 3, "the JobSet environment")
    two_jobs = {**JOBSET, "REPLICATED_JOB_REPLICAS": "2", "JOB_INDEX": "1", "JOB_COMPLETION_INDEX": "1"}
    assert distributed_settings(environ=two_jobs).process_id == 3  # 1 * (4 / 2) + 1
    given = {**JOBSET, "AXCORE_COORDINATOR_ADDRESS": "127.0.0.1:5555", "AXCORE_COORDINATOR_PORT": "1"}
    assert distributed_settings(environ=given).coordinator_address == "127.0.0.1:5555"


def test_slurm_is_left_to_jax_cluster_detection():
    assert distributed_settings(environ=SLURM) == DistributedSettings(None, None, None, "slurm")


@pytest.mark.parametrize(
    "args, environ, phrase",
    [
        (("10.0.0.1:1", None, 0), {}, "--num-processes missing"),
        ((None, 2, None), {}, "--coordinator, --process-id missing"),
        (("10.0.0.1:1", 2, 2), {}, "--process-id must be in 0..1 for 2 processes, got 2"),
        (("10.0.0.1", 2, 0), {}, "--coordinator must be HOST:PORT"),
        (("10.0.0.1:1", 0, 0), {}, "--num-processes must be at least 1"),
        ((None, None, None), {"AXCORE_PROCESS_ID": "0"}, "AXCORE_COORDINATOR_ADDRESS, AXCORE_NUM_PROCESSES missing"),
        ((None, None, None), {**JOBSET, "AXCORE_NUM_PROCESSES": "x"}, "AXCORE_NUM_PROCESSES (set it in the JobSet"),
        ((None, None, None), {**JOBSET, "REPLICATED_JOB_REPLICAS": "3"}, "not a multiple of REPLICATED_JOB_REPLICAS=3"),
    ],
)
def test_incomplete_or_invalid_settings_name_the_flag_or_variable(args, environ, phrase):
    with pytest.raises(DistributedError) as raised:
        distributed_settings(*args, environ=environ)
    assert phrase in str(raised.value)


def test_the_cli_reports_bad_settings_in_one_line(capsys):
    assert main(["train", "default", "--coordinator", "127.0.0.1:1", "--num-processes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--process-id missing" in err


@pytest.mark.parametrize(
    "coordinator, bound",
    [("127.0.0.1:8476", "127.0.0.1:8476"), ("localhost:9000", "127.0.0.1:9000"), ("0.0.0.0:77", "0.0.0.0:77")],
)
def test_the_coordinator_listens_on_its_own_address(coordinator, bound):
    assert coordinator_bind_address(coordinator, environ={}) == bound


def test_an_ipv6_coordinator_is_bracketed():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    assert coordinator_bind_address("[::1]:8476", environ={}) == "[::1]:8476"


def test_a_host_not_of_this_machine_listens_everywhere_with_a_warning(caplog):
    # 203.0.113.7 (TEST-NET-3) is no machine's own address: JAX's default, and a warning naming the way to choose.
    with caplog.at_level(logging.WARNING, logger="axcore.platform.distributed"):
        assert coordinator_bind_address("203.0.113.7:8476", environ={}) is None
    assert "203.0.113.7" in caplog.text and "JAX_COORDINATOR_BIND_ADDRESS=ADDRESS:8476" in caplog.text


def test_jax_coordinator_bind_address_and_slurm_leave_the_choice_to_jax():
    assert coordinator_bind_address("127.0.0.1:8476", environ={"JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.1:8476"}) is None
    assert coordinator_bind_address(None, environ={}) is None
