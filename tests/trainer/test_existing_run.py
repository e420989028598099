"""`axcore train` on an existing run directory (axcore/trainer/existing_run.py).

- A busy directory (locked by a live process), one holding another run (another plugin
  list and model) and a finished one are each answered before anything compiles (no
  compile line in the subprocess's output): refused in one line (exit 2) or "already
  finished" (exit 0). The finished run is left byte for byte as it was and still
  evaluates to the same loss.
- Model settings that keep the parameters (rematerialization) still resume.
- A step directory left uncommitted by pruning that a kill interrupted is removed at
  the next start, and later resumes never mention it again.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest

from axcore import cli
from axcore.checkpoint import OrbaxBackend, TensorStoreBackend
from axcore.experiment import load_experiment
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.existing_run import remove_interrupted_pruning, run_differences
from axcore.trainer.run_dir import FAILED_FILE, LOCK_FILE
from axcore.trainer.step import TrainStep

# Seconds an `axcore train` subprocess may take.
PROCESS_TIMEOUT = 180
# What the trainer prints once it compiled (and the kernel lines before it).
COMPILE_LINES = ("Compiled the train step", "Kernel for ")


def _overrides(run_dir, steps, extra=()):
    return [
        *TINY_OVERRIDES,
        f"trainer.run_dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.checkpoint.every_n_steps=1",
        "trainer.sample.num_tokens=4",
        *extra,
    ]


def _argv(overrides):
    return ["train", "default", *[a for o in overrides for a in ("--set", o)]]


def _axcore_train(overrides):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "axcore.cli", *_argv(overrides)]
    return subprocess.run(command, capture_output=True, text=True, timeout=PROCESS_TIMEOUT, env=env)


def _files(run_dir: pathlib.Path) -> dict[str, bytes]:
    """Every file of the run directory but the lock, with its bytes."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def _eval_json(run_dir, capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--max-batches", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _assert_before_compiling(proc):
    output = proc.stdout + proc.stderr
    assert not any(line in output for line in COMPILE_LINES), output
    assert "Traceback" not in output, output


@pytest.mark.slow
def test_a_busy_another_or_a_finished_run_is_answered_before_compiling(tmp_path, capsys):
    run_dir = tmp_path / "finished"
    assert cli.main(_argv(_overrides(run_dir, 2))) == 0
    before, evaluated = _files(run_dir), _eval_json(run_dir, capsys)

    other = _axcore_train(_overrides(run_dir, 2, ["plugins=[rope]", "model.num_layers=3"]))
    assert other.returncode == 2, other.stderr
    _assert_before_compiling(other)
    line = other.stderr.strip().splitlines()[-1]
    assert line.startswith(f"axcore: error: Run directory '{run_dir}' holds another run (plugins: saved [] vs now [rope]; ")
    assert "model.num_layers: saved 2 vs now 3" in line and "nothing was written to it" in line, line
    assert f"set trainer.run_dir to a new directory (with init_from={run_dir}" in line

    finished = _axcore_train(_overrides(run_dir, 2))
    assert finished.returncode == 0, finished.stderr
    _assert_before_compiling(finished)
    assert f"Run directory {run_dir} is already finished at step 2 (trainer.max_steps 2)" in finished.stderr
    assert finished.stdout == ""  # No sample.

    code = (
        "import sys, time; from axcore.trainer.run_dir import RunDirectory; "
        f"RunDirectory({str(run_dir)!r}).lock(); print('locked', flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = _axcore_train(_overrides(run_dir, 4))  # Unfinished at 4 steps: only the lock refuses it.
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert busy.returncode == 2, busy.stderr
    _assert_before_compiling(busy)
    assert busy.stderr.strip().splitlines()[-1].startswith(
        f"axcore: error: Run directory '{run_dir}' is in use by another run (host "
    ), busy.stderr
    assert f"pid {holder.pid}" in busy.stderr

    assert _files(run_dir) == before  # config.yaml, config.txt, checkpoints, metrics: byte for byte; no FAILED.
    assert not (run_dir / FAILED_FILE).exists()
    assert _eval_json(run_dir, capsys) == evaluated


def test_differences_keep_settings_that_leave_the_parameters(tmp_path):
    """The rule itself, on a saved config: what refuses and what is only noted (no training)."""
    base = [*TINY_OVERRIDES, f"trainer.run_dir={tmp_path}"]
    load_experiment("default", base).save(tmp_path)

    def differences(*overrides):
        exp = load_experiment("default", [*base, *overrides])
        return run_differences(tmp_path, exp, TrainStep(exp).op_environment)

    assert differences("trainer.max_steps=7", "trainer.learner.learning_rate=0.5", "input.batch_size=2") == ([], [])
    assert differences("model.remat_policy=nothing_saveable") == (
        [], ["model.remat_policy: saved null vs now nothing_saveable"]
    )
    refused, noted = differences("model.dim=64")
    assert noted == [] and refused[0] == "model.dim: saved 32 vs now 64"
    assert differences("plugins=[swiglu]")[0][0] == "plugins: saved [] vs now [swiglu]"


@pytest.mark.slow
def test_a_step_left_by_interrupted_pruning_is_removed_at_the_next_start(tmp_path):
    run_dir = tmp_path / "pruned"
    checkpoints = run_dir / "checkpoints"
    assert cli.main(_argv(_overrides(run_dir, 3, ["trainer.checkpoint.keep_last_n=null"]))) == 0
    # As orbax's pruning leaves step 1 when a kill lands in the middle of deleting it: no commit file, part gone.
    os.remove(checkpoints / "1" / "commit_success.txt")
    shutil.rmtree(checkpoints / "1" / "state")
    keep = ["trainer.checkpoint.keep_last_n=2"]
    proc = _axcore_train(_overrides(run_dir, 4, keep))
    assert proc.returncode == 0, proc.stderr
    assert "Removed checkpoint step(s) 1: left uncommitted by pruning that a kill interrupted." in proc.stderr
    assert "1" not in os.listdir(checkpoints) and "4" in os.listdir(checkpoints)
    again = _axcore_train(_overrides(run_dir, 5, keep))
    assert again.returncode == 0, again.stderr
    assert "checkpoint step 1" not in again.stderr.lower() and "step(s)" not in again.stderr, again.stderr
    assert "1" not in os.listdir(checkpoints) and "5" in os.listdir(checkpoints)


@pytest.mark.parametrize("backend_type", [OrbaxBackend, TensorStoreBackend])
def test_only_uncommitted_steps_older_than_the_latest_are_removed(tmp_path, backend_type):
    backend = backend_type(tmp_path, keep_last_n=None, async_save=False)
    for step in (1, 2, 3, 4):
        backend.save(step, {"w": jnp.full((3,), float(step))}, {"step": step})
    names = {s: n for s, n in zip((1, 2, 3, 4), sorted(os.listdir(tmp_path)))}
    marker = "commit_success.txt" if backend_type is OrbaxBackend else "COMMITTED"
    for step in (1, 4):  # 1: pruning interrupted; 4: a save interrupted (newer than the latest committed, 3).
        os.remove(tmp_path / names[step] / marker)
    lines = []
    assert remove_interrupted_pruning(backend, lines.append) == [1]
    assert lines == ["Removed checkpoint step(s) 1: left uncommitted by pruning that a kill interrupted."]
    assert sorted(os.listdir(tmp_path)) == [names[2], names[3], names[4]]
    assert backend.all_steps() == [2, 3] and backend.incomplete_steps() == [4]
    with pytest.raises(Exception, match="is committed; not discarding it"):
        backend.discard_incomplete(2)
    backend.close()


# `axcore train` whose data source (the embedded corpus's documents cut to one row each), when it reads its
# document number AXCORE_TEST_LOST_AT (in the loader's background thread, as the peer watch's thread would;
# document 40 belongs to batch 10), first waits for checkpoint step AXCORE_TEST_AFTER_STEP
# to be committed (if set), then stops the process the way the peer watch does when another process is lost.
LOST_PEER_SCRIPT = """
import os, sys, time
import axcore
from axcore.cli import main
from axcore.data.sources import EmbeddedCorpus
from axcore.platform import peer_watch

READS = [0]


class LosingCorpus(EmbeddedCorpus):
    class Config(EmbeddedCorpus.Config):
        pass

    def document(self, index):
        READS[0] += 1
        if READS[0] == int(os.environ["AXCORE_TEST_LOST_AT"]):
            after = os.environ.get("AXCORE_TEST_AFTER_STEP")
            marker = os.path.join(os.environ["AXCORE_TEST_RUN_DIR"], "checkpoints", after or "", "commit_success.txt")
            while after and not os.path.exists(marker):
                time.sleep(0.02)
            peer_watch._stop("axcore: error: lost process 1 of this 2-process job (test)")
        document = dict(super().document(index))
        document["tokens"] = document["tokens"][:33]  # One row each: read 4 per batch, in order.
        return document


class LosingPlugin:
    @axcore.hookimpl
    def axcore_register_data_sources(self, register):
        register("losing_corpus", LosingCorpus)


overrides = sys.argv[1:]
sys.exit(main(["train", "default", *[a for o in overrides for a in ("--set", o)]], objects={"losing": LosingPlugin()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("after_step", [None, 2])
def test_a_lost_peer_cleans_up_the_run_directory(tmp_path, after_step):
    """The peer watch ends the process with os._exit: the run directory is still marked FAILED with the
    lost-peer line, before the first checkpoint as after it."""
    script = tmp_path / "losing_train.py"
    script.write_text(LOST_PEER_SCRIPT)
    run_dir = tmp_path / "lost"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "AXCORE_TEST_RUN_DIR": str(run_dir),
           "AXCORE_TEST_LOST_AT": "1" if after_step is None else "40"}
    if after_step is not None:
        env["AXCORE_TEST_AFTER_STEP"] = str(after_step)
    overrides = _overrides(run_dir, 12, ["plugins=[losing]", "input.source={type: losing_corpus}",
                                         "trainer.checkpoint.every_n_steps=2", "trainer.checkpoint.keep_last_n=null",
                                         "input.packing=none", "input.prefetch=0", "input.read_threads=0"])
    proc = subprocess.run([sys.executable, str(script), *overrides], capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT, env=env)
    assert proc.returncode == 75, proc.stderr
    # The watch's thread ends the process; the main thread may still print a progress line after its line.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("axcore: error:")]
    assert errors == ["axcore: error: lost process 1 of this 2-process job (test)"], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (run_dir / FAILED_FILE).read_text() == "lost process 1 of this 2-process job (test)\n"
    latest = OrbaxBackend(run_dir / "checkpoints").latest_step() if (run_dir / "checkpoints").is_dir() else None
    assert latest is None if after_step is None else latest >= after_step
