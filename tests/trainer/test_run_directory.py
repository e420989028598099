"""One run per directory, clean-up of failed runs, metrics without duplicates, memory refusal.

- A second `axcore train` on a directory another run holds is refused with one line
  naming the holder, and the first run finishes untouched (its checkpoint restores
  and equals an undisturbed run's parameters bit for bit).
- A run that fails before its first checkpoint removes the directory it created; one
  that fails later leaves FAILED and keeps its checkpoints.
- Resuming drops the metrics records of steps after the restored checkpoint.
- A model that cannot fit in memory is refused before anything is allocated or created.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from axcore import cli
from axcore.checkpoint import OrbaxBackend
from axcore.experiment import load_experiment
from axcore.observe.writers import drop_records_after, read_jsonl_metrics
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.run_dir import FAILED_FILE, LOCK_FILE, RunDirectory, RunDirectoryError
from axcore.trainer.trainer import Trainer

# Seconds a training subprocess may take before it is killed.
PROCESS_TIMEOUT = 180


def _overrides(run_dir, steps, every=2, extra=()):
    return [
        *TINY_OVERRIDES,
        f"trainer.run_dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        f"trainer.checkpoint.every_n_steps={every}",
        "trainer.sample.num_tokens=0",
        *extra,
    ]


def _argv(overrides):
    return ["train", "default", *[a for o in overrides for a in ("--set", o)]]


def test_lock_is_exclusive_and_released(tmp_path):
    first, second = RunDirectory(tmp_path / "run"), RunDirectory(tmp_path / "run")
    first.acquire()
    assert first.created
    holder = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(RunDirectoryError, match=rf"in use by another run \(host .*, pid {os.getpid()}, since"):
        second.acquire()
    first.release()
    second.acquire()  # Released: the next run gets it.
    assert not second.created
    second.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    """flock dies with its process: a SIGKILLed run's directory can be taken at once."""
    code = (
        "import sys, time; from axcore.trainer.run_dir import RunDirectory; "
        f"RunDirectory({str(tmp_path / 'run')!r}).acquire(); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirectoryError, match=f"pid {proc.pid}"):
            RunDirectory(tmp_path / "run").acquire()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        taken = RunDirectory(tmp_path / "run")
        taken.acquire()
        taken.release()
    finally:
        proc.kill()
        proc.wait()


# `axcore train` whose data source waits, when its 33rd train document is read, until the file named by
# AXCORE_TEST_GATE exists (a plugin object registers it); the documents are the embedded corpus's chapters
# cut to one row each (33 tokens), read unpacked (4 per batch) without the pipeline's own prefetch: reading
# batch 9 waits, so the pipeline (one batch ahead) never hands over batch 8 and the run stops before step 8.
GATED_TRAIN_SCRIPT = """
import os, sys, time
import axcore
from axcore.cli import main
from axcore.data.sources import EmbeddedCorpus

READS = [0]


class GatedCorpus(EmbeddedCorpus):
    class Config(EmbeddedCorpus.Config):
        pass

    def document(self, index):
        document = dict(super().document(index))
        document["tokens"] = document["tokens"][:33]
        READS[0] += 1
        while READS[0] == 33 and not os.path.exists(os.environ["AXCORE_TEST_GATE"]):
            time.sleep(0.02)
        return document


class GatePlugin:
    @axcore.hookimpl
    def axcore_register_data_sources(self, register):
        register("gated_corpus", GatedCorpus)


overrides = sys.argv[1:]
sys.exit(main(["train", "default", *[a for o in overrides for a in ("--set", o)]], objects={"gate": GatePlugin()}))
"""


@pytest.mark.slow
def test_a_second_run_on_the_same_directory_is_refused_and_the_first_is_untouched(tmp_path):
    script = tmp_path / "gated_train.py"
    script.write_text(GATED_TRAIN_SCRIPT)
    gate = tmp_path / "gate"
    env = dict(os.environ, AXCORE_TEST_GATE=str(gate))
    steps = 8

    def command(run_dir):
        extra = ["plugins=[gate]", "input.source={type: gated_corpus}", "trainer.checkpoint.keep_last_n=null",
                 "input.packing=none", "input.prefetch=0", "input.read_threads=0"]
        return [sys.executable, str(script), *_overrides(run_dir, steps, extra=extra)]

    run_dir = tmp_path / "shared"
    first = subprocess.Popen(command(run_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + PROCESS_TIMEOUT
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(read_jsonl_metrics(metrics)) >= 4):  # Waiting at the gate, step 4 saved.
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run never reached the gate"
            time.sleep(0.05)
        second = subprocess.run(command(run_dir), env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT)
        gate.touch()
        _, err = first.communicate(timeout=PROCESS_TIMEOUT)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"axcore: error: Run directory '{run_dir}' is in use by another run (host "
    ), second.stderr
    assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
    assert first.returncode == 0, err
    assert [r["step"] for r in read_jsonl_metrics(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    # Nothing corrupted: every checkpoint restores and equals an undisturbed run's, bit for bit.
    reference = tmp_path / "reference"
    assert subprocess.run(command(reference), env=env, capture_output=True, timeout=PROCESS_TIMEOUT).returncode == 0
    exp = load_experiment("default", [*TINY_OVERRIDES, "input.batch_size=4"])
    target = Trainer(exp).step.abstract_state()
    backends = [OrbaxBackend(d / "checkpoints") for d in (run_dir, reference)]
    assert backends[0].all_steps() == backends[1].all_steps() == [2, 4, 6, 8]
    for step in (2, 4, 6, 8):
        states = [b.restore(target, step)[0] for b in backends]
        for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), step
    for b in backends:
        b.close()


def test_a_run_failing_before_its_first_checkpoint_removes_its_directory(tmp_path, capsys):
    tokens = np.arange(4000, dtype=np.uint16) % 300  # Ids up to 299: not below the model's 256.
    token_file = tmp_path / "tokens.bin"
    tokens.tofile(token_file)
    run_dir = tmp_path / "failed"
    overrides = _overrides(run_dir, 4, extra=["input.source.type=token_file", f"input.source.path={token_file}"])
    assert cli.main(_argv(overrides)) == 2
    err = capsys.readouterr().err
    assert "holds token id " in err, err
    assert "outside the model's vocabulary [0, 256)" in err
    assert not run_dir.exists()


def test_a_run_failing_after_a_checkpoint_is_marked_failed(tmp_path, capsys):
    tokens = np.arange(4000, dtype=np.uint16) % 200
    # Documents of 33 tokens, one per row (4 rows of 32 targets per batch, in order): document 48 is read
    # around step 12 (the loader reads a few batches ahead), long after step 2's save.
    tokens[48 * 33 + 5] = 300
    token_file = tmp_path / "tokens.bin"
    tokens.tofile(token_file)
    run_dir = tmp_path / "failed_late"
    source = [
        "input.source.type=token_file", f"input.source.path={token_file}", "input.source.document_tokens=33",
        "input.shuffle=false", "input.packing=none",
    ]
    assert cli.main(_argv(_overrides(run_dir, 20, every=2, extra=source))) == 2
    err = capsys.readouterr().err
    assert f"token file '{token_file}' tokens {48 * 33}.. holds token id 300" in err, err
    assert f"Marked {run_dir} as failed (FAILED); its checkpoints are kept." in err
    assert "holds token id 300" in (run_dir / FAILED_FILE).read_text()
    assert (run_dir / "checkpoints").is_dir()
    again = RunDirectory(run_dir)  # The next run in the directory clears the mark.
    again.acquire()
    assert not (run_dir / FAILED_FILE).exists() and not again.created
    again.release()


def test_resuming_drops_metrics_of_redone_steps(tmp_path):
    run_dir = tmp_path / "resumed"
    assert cli.main(_argv(_overrides(run_dir, 4, every=2, extra=["trainer.checkpoint.keep_last_n=null"]))) == 0
    # As if the run had died after logging steps 3 and 4 but before committing step 4.
    backend = OrbaxBackend(run_dir / "checkpoints")
    assert backend.all_steps() == [2, 4]
    backend.close()
    shutil.rmtree(run_dir / "checkpoints" / "4")
    before = read_jsonl_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in before] == [1, 2, 3, 4]
    assert cli.main(_argv(_overrides(run_dir, 4, every=2))) == 0
    after = read_jsonl_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    assert [r["time"] for r in after[:2]] == [r["time"] for r in before[:2]]  # Steps 1-2 kept as written.
    assert after[2]["time"] > before[3]["time"]  # Steps 3-4 are the resumed run's.


def test_drop_records_after(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "x"')
    assert drop_records_after(path, 2) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_model_that_cannot_fit_is_refused_before_anything_exists(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # `axcore train` echoes it on stderr first.
    overrides = [*TINY_OVERRIDES, "model.dim=1048576", "model.vocab_size=1024", "trainer.max_steps=1"]  # Width's bound, 2**20.
    assert cli.main(_argv(overrides)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("axcore: error: The train state (parameters and optimizer state) needs ")
    assert "GiB per device, more than the" in err and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_a_huge_batch_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = [*TINY_OVERRIDES, "input.batch_size=1000000000", "trainer.max_steps=1"]
    assert cli.main(_argv(overrides)) == 2
    err = capsys.readouterr().err.strip()
    # Every field of the batch schema: 4 int32 fields and a float32 one, 20 bytes per token.
    assert "of host memory (input.batch_size x input.seq_len x 20 bytes)" in err, err
    assert os.listdir(tmp_path) == []


def test_the_compiled_estimate_is_checked_against_the_device(tmp_path, monkeypatch, capsys):
    """The compiled step's estimated peak is compared with what a device has (here made small)."""
    from axcore.trainer import memory_check

    monkeypatch.chdir(tmp_path)
    exp = load_experiment("default", [*TINY_OVERRIDES, "trainer.max_steps=1"])
    state_bytes = memory_check.per_device_bytes(Trainer(exp).step.abstract_state())
    # Room for the state, not for the step's activations and temporaries.
    monkeypatch.setattr(memory_check, "device_memory_bytes", lambda device: state_bytes + 1)
    assert cli.main(_argv([*TINY_OVERRIDES, "trainer.max_steps=1"])) == 2
    err = capsys.readouterr().err
    assert "The compiled train step needs an estimated" in err, err
    assert os.listdir(tmp_path) == []
