"""The training watchdog: stacks logged after the step timeout, exit 124 after the exit timeout, beats keep
it quiet, stop() cancels it, the faulthandler backstop exits even when the GIL is held, and a training run
whose data source hangs ends on its own. Every scenario that may exit runs in a subprocess with a bound."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import pytest

from axcore.errors import ConfigError
from axcore.observe import read_jsonl_metrics
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.watchdog import EXIT_HANG, Watchdog

REPO = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu",
       "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
PRELUDE = "import ctypes, sys, threading, time\nfrom axcore.trainer.watchdog import Watchdog\nLOG = sys.argv[1]\n"

# Scenario scripts (given the log path as argv[1]); all run at once, each in its own process.
SCENARIOS = {
    # A beat at step 7, then the main thread sleeps (GIL released): stacks at 0.3 s, exit 124 at 0.6 s.
    "hang": """
        w = Watchdog(0.3, 0.3, LOG)
        w.beat(7)
        def hung_in_step_eight():
            time.sleep(30)
        hung_in_step_eight()
    """,
    # The main thread sleeps in C holding the GIL: the Python thread cannot run, faulthandler exits 1.
    "gil": """
        w = Watchdog(0.3, 0.3, LOG)
        w.beat(7)
        def hung_holding_the_gil():
            ctypes.PyDLL(None).sleep(30)
        hung_holding_the_gil()
    """,
    # Beats every 0.1 s for 2 s (longer than the backstop's 1.8 s, so beats must re-arm it), then stop()
    # and 2 s more without beats (past both deadlines): nothing may fire.
    "quiet": """
        w = Watchdog(0.5, 0.3, LOG)
        for i in range(20):
            time.sleep(0.1)
            w.beat(i)
        w.stop()
        assert "axcore-watchdog" not in [t.name for t in threading.enumerate()]
        time.sleep(2.0)
        print("survived")
    """,
    # Stacks at 0.3 s, the step finishes at 0.6 s (before the exit at 1.3 s), then beats until 2.6 s:
    # past the exit backstop armed at the dump (0.3 + 1.0 + 1.0 s), so the recovery must re-arm it.
    "recovers": """
        w = Watchdog(0.3, 1.0, LOG)
        w.beat(1)
        time.sleep(0.6)
        for i in range(20):
            w.beat(2 + i)
            time.sleep(0.1)
        w.stop()
        print("survived")
    """,
    # exit_timeout_s=0: stacks once (the backstop's own dump at 1.3 s is cancelled), never an exit.
    "log_only": """
        w = Watchdog(0.3, 0, LOG)
        w.beat(5)
        def slow_step():
            time.sleep(2.0)
        slow_step()
        w.stop()
        print("survived")
    """,
}


def _finish(proc, deadline):
    """(returncode, stdout, stderr) of `proc`, killed if it runs past `deadline` (time.monotonic())."""
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running at its time bound; stdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """name -> (returncode, stdout, stderr, log text or None) of each scenario, run in parallel."""
    root = tmp_path_factory.mktemp("watchdog")
    procs = {}
    try:
        for name, body in SCENARIOS.items():
            script = root / f"{name}.py"  # A file, so that the logged stacks show source lines.
            script.write_text(PRELUDE + textwrap.dedent(body))
            log = root / name / "watchdog.log"
            procs[name] = (log, subprocess.Popen([sys.executable, str(script), str(log)], env=ENV, text=True,
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 60
        results = {}
        for name, (log, proc) in procs.items():
            results[name] = (*_finish(proc, deadline), log.read_text() if log.exists() else None)
        return results
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_hang_writes_all_stacks_then_exits_124(scenarios):
    rc, _, err, log = scenarios["hang"]
    assert rc == EXIT_HANG == 124, err
    first, second = err.strip().splitlines()
    match = re.fullmatch(r"axcore: watchdog: no progress for (\d+\.\d) s \(training, last step 7; timeout 0\.3 s\); "
                         r"all thread stacks written to (.+); exiting with status 124 in 0\.3 s unless it recovers\.",
                         first)
    assert match and float(match[1]) >= 0.3 and match[2].endswith("hang/watchdog.log"), first
    assert second.startswith("axcore: watchdog: still no progress after ") and "exiting with status 124" in second
    # Python-formatted stacks of every thread, the hung frame among them, then the exit after both timeouts.
    assert "Thread MainThread" in log and "Thread axcore-watchdog" in log
    assert "in hung_in_step_eight\n    time.sleep(30)" in log
    exited = re.search(r"exited with status 124 after (\d+\.\d) s", log)
    assert exited and 0.6 <= float(exited[1]) < 5, log


def test_a_hang_holding_the_gil_is_ended_by_the_faulthandler_backstop(scenarios):
    rc, _, err, log = scenarios["gil"]
    assert rc == 1, err  # faulthandler's exit status: the Python thread never got the GIL back.
    assert "axcore: watchdog" not in err
    assert "most recent call first" in log and "hung_holding_the_gil" in log, log


def test_beats_keep_it_quiet_and_stop_cancels_everything(scenarios):
    rc, out, err, log = scenarios["quiet"]
    assert (rc, out.strip(), err) == (0, "survived", "")
    assert log == ""  # Created when armed, never written.


def test_a_slow_step_that_finishes_before_the_exit_timeout_cancels_the_exit(scenarios):
    rc, out, err, log = scenarios["recovers"]
    assert (rc, out.strip()) == (0, "survived"), err
    assert err.count("axcore: watchdog: no progress") == 1 and "still no progress" not in err
    assert log.count("=== axcore watchdog") == 1 and "exited" not in log and "most recent call first" not in log


def test_exit_timeout_zero_only_logs(scenarios):
    rc, out, err, log = scenarios["log_only"]
    assert (rc, out.strip()) == (0, "survived"), err
    assert "not exiting (trainer.watchdog.exit_timeout_s=0)" in err and "last step 5" in err
    assert log.count("=== axcore watchdog") == 1 and "in slow_step" in log
    assert "most recent call first" not in log  # The backstop's dump was cancelled.


def test_disabled_watchdog_does_nothing_and_negative_timeouts_are_config_errors(tmp_path):
    watchdog = Watchdog(0, 1.0, tmp_path / "watchdog.log")
    watchdog.beat(1)
    assert watchdog._thread is None and not (tmp_path / "watchdog.log").exists()
    watchdog.stop()
    for args in ((-1, 1), (1, -1), (float("nan"), 1)):
        with pytest.raises(ConfigError, match="trainer.watchdog"):
            Watchdog(*args, tmp_path / "watchdog.log")


# A training run whose data source hangs when the 4th batch is read; a plugin object registers the source.
TRAIN_SCRIPT = """
import sys, time
import numpy as np
import axcore
from axcore.cli import main
from axcore.data import Split
from axcore.data.sources import EmbeddedCorpus


def data_source_hangs_forever():
    while True:
        time.sleep(1)


class HangingCorpus(EmbeddedCorpus):
    class Config(EmbeddedCorpus.Config):
        \"\"\"Configures HangingCorpus.\"\"\"

    reads = 0

    def document(self, index):
        HangingCorpus.reads += 1
        if HangingCorpus.reads == 2:  # The first chapter fills many batches; the loader then stalls.
            data_source_hangs_forever()
        return super().document(index)


class HangPlugin:
    @axcore.hookimpl
    def axcore_register_data_sources(self, register):
        register("hanging_corpus", HangingCorpus)


overrides = sys.argv[1:]
sys.exit(main(["train", "default", *[a for o in overrides for a in ("--set", o)]], objects={"hang": HangPlugin()}))
"""


def test_training_with_a_hanging_data_source_logs_stacks_and_exits(tmp_path):
    run = tmp_path / "run"
    overrides = [
        *TINY_OVERRIDES, f"trainer.run_dir={run}", "plugins=[hang]", "input.source={type: hanging_corpus}",
        "trainer.max_steps=500", "trainer.eval_every=0", "trainer.log_every=1", "trainer.checkpoint.every_n_steps=0",
        "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]",
        # Tiny timeouts: compiling the first step takes longer, but the watchdog is armed only after it.
        "trainer.watchdog.step_timeout_s=2", "trainer.watchdog.exit_timeout_s=1",
    ]
    script = tmp_path / "train_hanging.py"
    script.write_text(TRAIN_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), *overrides], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        rc, _, err = _finish(proc, time.monotonic() + 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == EXIT_HANG, err
    lines = [line for line in err.splitlines() if line.startswith("axcore: watchdog: no progress")]
    assert len(lines) == 1, err
    # The steps whose batches were read before the source hung ran (one metrics record each); the next never came.
    last = re.search(r"\(training, last step (\d+); timeout 2 s\); all thread stacks written to (\S+);", lines[0])
    assert last and last[2] == str(run / "watchdog.log") and int(last[1]) >= 1, lines[0]
    assert [r["step"] for r in read_jsonl_metrics(run / "metrics.jsonl")] == list(range(1, int(last[1]) + 1))
    log = (run / "watchdog.log").read_text()
    # The loader's thread hangs in the source; the training thread waits for its next batch.
    assert "in data_source_hangs_forever" in log and "in document" in log and "in run" in log, log
    exited = re.search(r"exited with status 124 after (\d+\.\d) s", log)
    assert exited and 3.0 <= float(exited[1]) < 10, log
    # The immediate exit still marks the run (axcore.platform.exit_hooks), keeping its stacks.
    failed = (run / "FAILED").read_text()
    assert failed.startswith("watchdog: still no progress after ") and f"(stacks in {run / 'watchdog.log'})" in failed
