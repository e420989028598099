"""Ctrl-C during `axcore train`: the last step is saved and committed, the run is marked INTERRUPTED
(not FAILED), one line gives the exact command that resumes it, the exit status is 130; a second
Ctrl-C stops at once without a new checkpoint and leaves the committed ones intact.

Real `axcore train` processes get a real SIGINT (axcore/trainer/interrupt.py).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

from axcore.checkpoint import OrbaxBackend
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.run_dir import FAILED_FILE, INTERRUPTED_FILE

# Seconds a training subprocess may take before it is killed.
PROCESS_TIMEOUT = 240
SETTINGS = [*TINY_OVERRIDES, "trainer.log_every=1", "trainer.eval_every=0", "trainer.sample.num_tokens=0"]
# A driver that runs `axcore train` with one more checkpoint backend, `slow`: orbax, except that a
# save off the checkpoint interval (the one Ctrl-C asks for) first sleeps, so it is still in flight.
SLOW_DRIVER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # As in a terminal (see AXCORE).
import axcore
from axcore.checkpoint.plugin import orbax
from axcore.cli import main

def slow(directory, **settings):
    backend = orbax(directory, **settings)
    save = backend.save
    def slow_save(step, state, metadata):
        if step % 50:
            print(f"slow save of step {step}", file=sys.stderr, flush=True)
            time.sleep(120)
        save(step, state, metadata)
    backend.save = slow_save
    return backend

class Slow:
    @axcore.hookimpl
    def axcore_register_checkpoint_backends(self, register):
        register("slow", slow)

sys.exit(main(sys.argv[1:], objects={"slow": Slow()}))
"""

# A driver that runs `axcore train` and prints "device finished step N" as each step completes on the
# device: a thread of its own waits for each step's loss, so the loop's dispatch stays as it is (a host
# callback inside the step would make XLA:CPU run it synchronously).
MARKED_DRIVER = """
import queue, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)  # As in a terminal (see AXCORE).
from axcore.cli import main
from axcore.trainer.trainer import Trainer

compile_train_step = Trainer._compile_train_step

def marked_compile(self):
    step, dispatched, count = compile_train_step(self), queue.Queue(), [0]

    def watch():
        while True:
            n, loss = dispatched.get()
            loss.block_until_ready()
            print(f"device finished step {n}", file=sys.stderr, flush=True)

    threading.Thread(target=watch, daemon=True).start()

    def marked(state, batch):
        state, metrics = step(state, batch)
        count[0] += 1
        dispatched.put((count[0], metrics["loss"]))
        return state, metrics
    return marked

Trainer._compile_train_step = marked_compile
sys.exit(main(sys.argv[1:]))
"""
# A model whose step takes long on a CPU beside the test's reaction to a line, and compiles in seconds.
SLOW_STEP = ["model.dim=256", "model.num_layers=2", "model.position_embedding.max_len=128",
             "model.decoder.layer.self_attention.num_heads=4", "model.decoder.layer.feed_forward.hidden_dim=1024",
             "input.batch_size=8", "input.seq_len=128"]


# `axcore train ARGS`, with Python's own SIGINT handler as in a terminal (a test run started as a
# background shell job passes SIGINT on as ignored, and Python then leaves it ignored).
AXCORE = [
    sys.executable, "-c",
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from axcore.cli import main; sys.exit(main(sys.argv[1:]))",
]


def _start(argv, cwd):
    return subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _wait_for(proc, pattern):
    """Reads stderr lines until one matches `pattern`; returns the lines read."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if re.match(pattern, line):
            return lines
    raise AssertionError(f"the run ended (status {proc.wait()}) before {pattern!r}:\n{''.join(lines)[-3000:]}")


def _finish(proc, lines):
    try:
        _, rest = proc.communicate(timeout=PROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return "".join(lines) + rest


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def test_ctrl_c_saves_the_last_step_and_prints_the_command_that_resumes(tmp_path):
    # A timestamped run directory (the default) and a checkpoint interval the run never reaches.
    overrides = [*SETTINGS, "trainer.max_steps=1000000", "trainer.checkpoint.every_n_steps=1000000"]
    proc = _start([*AXCORE, "train", *_sets(overrides)], tmp_path)
    lines = _wait_for(proc, r"step [5-9]/")
    proc.send_signal(signal.SIGINT)
    err = _finish(proc, lines)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    [run_dir] = (tmp_path / "runs").iterdir()
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(r"Interrupted at step (\d+); saved\. Resume with: (.*)", last)
    assert match, last
    step, command = int(match.group(1)), shlex.split(match.group(2))
    # The user's command, with the directory the run chose.
    relative = run_dir.relative_to(tmp_path)
    assert command == ["axcore", "train", *_sets(overrides), "--set", f"trainer.run_dir={relative}"]
    assert step >= 5
    backend = OrbaxBackend(run_dir / "checkpoints")
    assert backend.all_steps() == [step]  # Committed (its marker exists), and nothing else was saved.
    backend.close()
    assert not (run_dir / FAILED_FILE).exists()
    assert (run_dir / INTERRUPTED_FILE).read_text().strip() == last

    # The printed command resumes (capped a few steps later, so that it ends) and clears the mark.
    resumed = subprocess.run(
        [sys.executable, "-m", "axcore.cli", *command[1:], "--set", f"trainer.max_steps={step + 3}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=PROCESS_TIMEOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from step {step} in {relative}" in resumed.stderr
    assert f"Finished step {step + 3}; run directory: {relative}" in resumed.stderr
    assert not (run_dir / INTERRUPTED_FILE).exists() and not (run_dir / FAILED_FILE).exists()


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_committed_checkpoints(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(SLOW_DRIVER)
    overrides = [
        *SETTINGS, "plugins=[slow]", "trainer.checkpoint.backend=slow", "trainer.run_dir=run",
        "trainer.max_steps=1000000", "trainer.checkpoint.every_n_steps=50",
    ]
    proc = _start([sys.executable, str(driver), "train", *_sets(overrides)], tmp_path)
    lines = _wait_for(proc, r"step 1[2-9]\d/")  # Steps 50 and 100 are saved.
    proc.send_signal(signal.SIGINT)
    lines += _wait_for(proc, r"slow save of step \d+")  # The Ctrl-C save is in flight (sleeping) ...
    stopped_at = int(lines[-1].split()[-1])
    proc.send_signal(signal.SIGINT)  # ... when the second Ctrl-C comes.
    err = _finish(proc, lines)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    backend = OrbaxBackend(tmp_path / "run" / "checkpoints")
    committed = backend.all_steps()
    backend.close()
    # Step 50 at least (100's own async save may still have been in flight): only interval steps, never
    # the step whose save was abandoned; each committed one restores (the resume below checks the latest).
    assert committed and committed[0] == 50 and all(s % 50 == 0 for s in committed), committed
    assert stopped_at % 50 and stopped_at not in committed
    latest = committed[-1]
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(rf"Interrupted again: stopped at once, nothing more saved\. Resume from step {latest} with: (.*)", last)
    assert match, last
    assert (tmp_path / "run" / INTERRUPTED_FILE).read_text().strip() == last
    assert not (tmp_path / "run" / FAILED_FILE).exists()

    command = shlex.split(match.group(1))
    assert command == ["axcore", "train", *_sets(overrides)]  # trainer.run_dir was given: nothing added.
    resumed = subprocess.run(
        # To the next interval step, which the slow backend saves without sleeping.
        [sys.executable, str(driver), *command[1:], "--set", f"trainer.max_steps={latest + 50}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=PROCESS_TIMEOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from step {latest} in run" in resumed.stderr  # The committed checkpoint verifies.
    assert f"Finished step {latest + 50}; run directory: run" in resumed.stderr


def test_ctrl_c_lands_within_one_step_of_the_key(tmp_path):
    # Metrics are fetched every 10 steps only: the loop must not run ahead to the next fetch before it
    # sees the key (it did: the key after step 3 stopped the run at step 11).
    driver = tmp_path / "driver.py"
    driver.write_text(MARKED_DRIVER)
    overrides = [*SLOW_STEP, "trainer.log_every=10", "trainer.eval_every=0", "trainer.sample.num_tokens=0",
                 "trainer.run_dir=run", "trainer.max_steps=1000", "trainer.checkpoint.every_n_steps=1000000"]
    proc = _start([sys.executable, str(driver), "train", *_sets(overrides)], tmp_path)
    done = 3
    lines = _wait_for(proc, rf"device finished step {done}$")
    proc.send_signal(signal.SIGINT)  # While the device runs step done + 1.
    err = _finish(proc, lines)
    assert proc.returncode == 130, err[-3000:]
    match = re.search(r"^Interrupted at step (\d+); saved\.", err, re.M)
    assert match, err[-3000:]
    stopped = int(match.group(1))
    # The step the device ran finishes, and at most the one queued behind it: nothing later is dispatched.
    assert done + 1 <= stopped <= done + 2, err[-3000:]
    assert max(int(n) for n in re.findall(r"^device finished step (\d+)$", err, re.M)) == stopped
    backend = OrbaxBackend(tmp_path / "run" / "checkpoints")
    assert backend.all_steps() == [stopped]
    backend.close()
    # The interrupted run has its loss plot (of the step fetched at the stop).
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
