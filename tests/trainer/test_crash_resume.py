"""Crash tests: `axcore train` killed with SIGKILL at random moments, restarted, bit-identical at the end.

For each checkpoint backend, one uninterrupted reference run, then the same command
(same run directory) is started, SIGKILLed and restarted until a schedule of kills is
done, and finally allowed to finish. The schedule is random, from a seed printed in
every failure message (set AXCORE_CRASH_SEED=<seed> to replay it; the kill *moments*
still depend on timing). Kinds of kill:

- `save`: during a checkpoint save. The parent polls the checkpoint directory for the
  step directory of a save that has no commit marker yet (orbax: `<step>/` without
  `commit_success.txt`; tensorstore: `step_XXXXXXXX/` without `COMMITTED`), waits a
  random few milliseconds, checks it is still uncommitted and kills. After the
  process is dead the directory must still be uncommitted, which proves the kill
  interrupted that save; a save that committed first is not counted, and another
  save is targeted (in the same process if one is left, else in the next).
  Only steps above every step directory present at the start are targeted, so a
  directory left over by an earlier kill is never mistaken for a save in progress.
- `step`: a random few hundred milliseconds after the progress line of a random step
  of the training loop (it may land in a save, which is then counted as one if that
  step's directory did not exist when the process started).
- `anytime`: a random moment between process start and 0.8 x the shortest time a
  process of the crash run took to its first step line: start-up, restore or compile.

Each backend gets 3 kills (2 `save`, and `step` or `anytime`), more if a targeted save
committed before its kill: at least 2 verified during a save. At the
end: every process exited 0 or was killed by the test, the final state (parameters,
optimizer state, step, PRNG key) read with the backend's `restore` equals the
reference run's leaf by leaf (`np.array_equal`, same dtype), and so does the
checkpoint metadata (the input pipeline's state included: packed rows from a weighted
mixture of two sources), and the metrics file lists every step exactly once.

The processes share a persistent JAX compilation cache (filled by the first reference
run), so a restart costs ~4 s instead of ~10 s; the cache holds the same compiled
programs, so the results do not depend on it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from axcore.experiment import load_experiment
from axcore.observe import read_jsonl_metrics
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

pytestmark = pytest.mark.slow

MAX_STEPS = 20  # Steps take ~20 ms; the margin leaves saves to target after several kills.
EVERY = 2  # Checkpoint every 2 steps: saves at 2, 4, ..., 20.
SAVE_KILLS = 2  # Verified kills during a save, per backend.
OTHER_KILLS = ("step", "anytime")  # One of these, drawn at random, per backend.
MAX_EXTRA_SAVE_ATTEMPTS = 3  # Further save kills if a targeted save committed before the kill.
PROCESS_TIMEOUT_S = 90.0  # Any single `axcore train` process.
SAVE_KILL_DELAY_S = 0.03  # Upper bound of the random delay after seeing a save in progress.
STEP_KILL_DELAY_S = 0.15  # Upper bound of the random delay after a progress line.

CONFIG = [
    *TINY_OVERRIDES,
    "trainer.eval_every=0",
    "trainer.sample.num_tokens=0",
    "trainer.log_every=1",
    f"trainer.max_steps={MAX_STEPS}",
    f"trainer.checkpoint.every_n_steps={EVERY}",
    "trainer.checkpoint.async_save=true",
    "trainer.learner.schedule.warmup_steps=2",
    "model.decoder.layer.dropout_rate=0.1",  # Per-step randomness must resume exactly too.
    "trainer.metrics_writers=[{type: jsonl}]",
    # Packed rows (first_fit, the default) from a weighted mixture: the pipeline's state must resume exactly.
    "input.packing=first_fit",
    "input.mixture=[{name: book, weight: 3, source: {type: embedded_corpus}},"
    " {name: other, weight: 1, source: {type: embedded_corpus, eval_fraction: 0.5}}]",
]


def _overrides(backend: str, run_dir: pathlib.Path) -> list[str]:
    return [*CONFIG, f"trainer.checkpoint.backend={backend}", f"trainer.run_dir={run_dir}"]


# -- the checkpoint directory on disk ------------------------------------------------------


def _step_dirs(backend: str, run_dir: pathlib.Path) -> dict[int, bool]:
    """{step: committed} of every step directory in the run's checkpoint directory."""
    if backend == "orbax":
        from orbax.checkpoint.path import atomicity

        marker = atomicity.COMMIT_SUCCESS_FILE
        parse = lambda name: int(name) if name.isdigit() else None  # noqa: E731
    else:
        from axcore.checkpoint.tensorstore_backend import COMMIT_MARKER as marker

        parse = lambda name: int(m.group(1)) if (m := re.fullmatch(r"step_(\d{8,})", name)) else None  # noqa: E731
    directory = run_dir / "checkpoints"
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        step = parse(name)
        if step is not None:
            out[step] = os.path.exists(directory / name / marker)
    return out


def _step_dir_state(backend: str, run_dir: pathlib.Path, step: int) -> str:
    """'absent', 'uncommitted' or 'committed'."""
    dirs = _step_dirs(backend, run_dir)
    if step not in dirs:
        return "absent"
    return "committed" if dirs[step] else "uncommitted"


# -- one `axcore train` process -----------------------------------------------------------


class TrainProcess:
    """`python -m axcore.cli train` in its own process group; output lines collected with arrival times."""

    def __init__(self, backend: str, run_dir: pathlib.Path, env: dict[str, str]):
        argv = [sys.executable, "-m", "axcore.cli", "train", "default"]
        for item in _overrides(backend, run_dir):
            argv += ["--set", item]
        self.started = time.monotonic()
        self.deadline = self.started + PROCESS_TIMEOUT_S
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.killed = False

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append((time.monotonic() - self.started, raw.decode(errors="replace").rstrip()))

    def running(self) -> bool:
        return self.proc.poll() is None

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"an `axcore train` process ran past {PROCESS_TIMEOUT_S:.0f} s")

    def steps_logged(self) -> list[int]:
        """The steps of the progress lines printed so far (`step N/20 | ...`)."""
        return [int(m.group(1)) for _, line in list(self.lines) if (m := re.match(r"step (\d+)/", line))]

    def kill(self) -> None:
        """SIGKILL to the whole process group; returns once the process is reaped."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.killed = True
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)

    def wait(self) -> int:
        try:
            rc = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"an `axcore train` process ran past {PROCESS_TIMEOUT_S:.0f} s") from None
        self._reader.join(timeout=5)
        return rc

    def output(self, last: int = 40) -> str:
        return "\n".join(f"  [{t:6.2f}s] {line}" for t, line in self.lines[-last:])


@dataclasses.dataclass
class Kill:
    kind: str  # save | step | anytime
    at_s: float  # Seconds after the process started.
    during_save: int | None  # The step whose save the kill interrupted (verified on disk), else None.
    note: str
    last_line: str

    def describe(self) -> str:
        where = f"during the save of step {self.during_save}" if self.during_save is not None else "not during a save"
        return f"{self.kind} kill at {self.at_s:.2f} s, {where} ({self.note}); last line: {self.last_line!r}"


# -- the test ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def child_env(tmp_path_factory) -> dict[str, str]:
    """Environment of the `axcore train` processes: a persistent compilation cache shared by the module."""
    cache = tmp_path_factory.mktemp("jax-cache")
    env = dict(os.environ)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
    )
    return env


def _seed() -> int:
    value = os.environ.get("AXCORE_CRASH_SEED")
    return int(value) if value else random.SystemRandom().randrange(1 << 31)


def _final_state(backend: str, run_dir: pathlib.Path):
    """(state, metadata, step) of the latest committed checkpoint, read with the backend's restore."""
    exp = load_experiment(None, _overrides(backend, run_dir))
    trainer = Trainer(exp)
    store = exp.registries.checkpoint_backends[backend](run_dir / "checkpoints")
    try:
        step = store.latest_step()
        state, metadata = store.restore(trainer.step.abstract_state())
    finally:
        store.close()
    return jax.device_get(state), metadata, step


class CrashRun:
    """Drives the kill schedule of one backend; `log` collects what happened for failure messages."""

    def __init__(self, backend: str, run_dir: pathlib.Path, env: dict[str, str], seed: int, first_step_s: float):
        self.backend, self.run_dir, self.env = backend, run_dir, env
        self.seed = seed
        self.rng = random.Random(f"{seed}-{backend}")
        self.first_step_s = first_step_s
        self.kills: list[Kill] = []
        self.log: list[str] = [f"seed {seed} (replay: AXCORE_CRASH_SEED={seed}), backend {backend}"]
        self.processes: list[TrainProcess] = []

    def fail(self, message: str, proc: TrainProcess | None = None) -> None:
        text = [message, *self.log, *(k.describe() for k in self.kills)]
        if proc is not None:
            text.append("output of the process:\n" + proc.output())
        pytest.fail("\n".join(text), pytrace=False)

    def start(self) -> TrainProcess:
        proc = TrainProcess(self.backend, self.run_dir, self.env)
        self.processes.append(proc)
        return proc

    def unexpected_exit(self, proc: TrainProcess) -> None:
        rc = proc.wait()
        text = "\n".join(line for _, line in proc.lines)
        if rc == 0:
            self.fail(f"process {len(self.processes)} finished (step {MAX_STEPS}) before its planned kill", proc)
        why = " (a run-directory lock refused the restart?)" if re.search(r"lock", text, re.I) else ""
        self.fail(f"process {len(self.processes)} exited with status {rc} on its own{why}", proc)

    # -- kinds of kill ---------------------------------------------------------------------

    def kill_during_save(self, proc: TrainProcess, present: dict[int, bool]) -> Kill | None:
        """Kills during a save of a step above every step directory present at start; None if none was caught."""
        floor = max(present, default=0)
        targets = [s for s in range(EVERY, MAX_STEPS + 1, EVERY) if s > floor]
        if not targets:
            return None
        # A random one of the next two saves; later ones if it commits before the kill.
        first = self.rng.choice(targets[:2])
        for step in [s for s in targets if s >= first]:
            while _step_dir_state(self.backend, self.run_dir, step) != "uncommitted":
                if _step_dir_state(self.backend, self.run_dir, step) == "committed":
                    break  # Committed between two polls: try the next save.
                if not proc.running():
                    self.unexpected_exit(proc)
                proc.check_time()
                time.sleep(0.0005)
            else:
                seen = time.monotonic()
                delay = self.rng.uniform(0.0, SAVE_KILL_DELAY_S)
                time.sleep(delay)
                if _step_dir_state(self.backend, self.run_dir, step) != "uncommitted":
                    self.log.append(f"  save of step {step} committed within {delay * 1e3:.0f} ms of being seen; next save")
                    continue
                at = time.monotonic() - proc.started
                proc.kill()
                window = time.monotonic() - seen
                if _step_dir_state(self.backend, self.run_dir, step) == "uncommitted":
                    return Kill("save", at, step, f"step {step} seen uncommitted, killed after {delay * 1e3:.1f} ms",
                                proc.lines[-1][1] if proc.lines else "")
                self.log.append(f"  save of step {step} committed before the kill took effect ({window * 1e3:.0f} ms)")
                return Kill("save", at, None, f"targeted step {step}, but it committed first",
                            proc.lines[-1][1] if proc.lines else "")
            self.log.append(f"  save of step {step} committed before it was seen uncommitted; next save")
        return None

    def kill_at_step(self, proc: TrainProcess, present: dict[int, bool]) -> Kill:
        start = max((s for s, committed in present.items() if committed), default=0)
        step = self.rng.randint(start + 1, max(start + 1, min(start + 4, MAX_STEPS - 6)))
        delay = self.rng.uniform(0.0, STEP_KILL_DELAY_S)
        while step not in proc.steps_logged():
            if not proc.running():
                self.unexpected_exit(proc)
            proc.check_time()
            time.sleep(0.002)
        time.sleep(delay)
        return self._kill_now(proc, present, "step", f"{delay * 1e3:.0f} ms after the line of step {step}")

    def kill_anytime(self, proc: TrainProcess, present: dict[int, bool]) -> Kill:
        delay = self.rng.uniform(0.0, 0.8 * self.first_step_s)
        while time.monotonic() - proc.started < delay:
            if not proc.running():
                self.unexpected_exit(proc)
            time.sleep(0.005)
        return self._kill_now(proc, present, "anytime", f"{delay:.2f} s after start")

    def _kill_now(self, proc: TrainProcess, present: dict[int, bool], kind: str, note: str) -> Kill:
        if not proc.running():
            self.unexpected_exit(proc)
        at = time.monotonic() - proc.started
        proc.kill()
        # Verified during a save: a step directory that did not exist at start is uncommitted now.
        fresh = sorted(s for s, committed in _step_dirs(self.backend, self.run_dir).items()
                       if not committed and s not in present)
        return Kill(kind, at, fresh[-1] if fresh else None, note, proc.lines[-1][1] if proc.lines else "")

    # -- the schedule ----------------------------------------------------------------------

    def run(self) -> None:
        plan = ["save"] * SAVE_KILLS + [self.rng.choice(OTHER_KILLS)]
        self.rng.shuffle(plan)
        if plan[0] == "anytime":  # Its moment is drawn from an earlier crash-run process's start-up time.
            plan[0], plan[1] = plan[1], plan[0]
        self.log.append(f"plan: {plan}")
        extra = 0
        while True:
            verified = sum(k.during_save is not None for k in self.kills)
            if not plan and verified < SAVE_KILLS and extra < MAX_EXTRA_SAVE_ATTEMPTS:
                plan.append("save")  # Retry: a targeted save committed before the kill.
                extra += 1
            present = _step_dirs(self.backend, self.run_dir)
            proc = self.start()
            if not plan:
                rc = proc.wait()
                if rc != 0:
                    self.fail(f"the final run exited with status {rc}", proc)
                self.log.append(f"process {len(self.processes)}: ran to the end in {time.monotonic() - proc.started:.1f} s")
                return
            kind = plan.pop(0)
            if kind == "save":
                kill = self.kill_during_save(proc, present)
                if kill is None:
                    self.fail(f"no save left to kill (step directories at start: {sorted(present)})", proc)
            elif kind == "step":
                kill = self.kill_at_step(proc, present)
            else:
                kill = self.kill_anytime(proc, present)
            self.kills.append(kill)
            first = next((t for t, line in proc.lines if re.match(r"step \d+/", line)), None)
            if first is not None:  # Start-up (with restore) under the warm compilation cache.
                self.first_step_s = min(first, self.first_step_s)
            self.log.append(f"process {len(self.processes)} (step dirs at start {sorted(present)}): {kill.describe()}")

    def stop_all(self) -> None:
        for proc in self.processes:
            if proc.running():
                proc.kill()


@pytest.mark.parametrize("backend", ["orbax", "tensorstore"])
def test_sigkill_at_random_moments_and_during_saves_resumes_bit_identically(tmp_path, backend, child_env):
    seed = _seed()
    reference_dir, crash_dir = tmp_path / "reference", tmp_path / "crashed"
    crash = CrashRun(backend, crash_dir, child_env, seed, first_step_s=float("inf"))
    reference = None
    try:
        reference = TrainProcess(backend, reference_dir, child_env)
        if reference.wait() != 0:
            crash.fail("the uninterrupted reference run failed", reference)
        first_step = next((t for t, line in reference.lines if line.startswith("step 1/")), None)
        assert first_step is not None, reference.output()
        crash.log.append(f"reference run: first step at {first_step:.2f} s, "
                         f"{time.monotonic() - reference.started:.1f} s in all")
        crash.run()
    finally:
        if reference is not None and reference.running():
            reference.kill()
        crash.stop_all()

    kills = crash.kills
    if len(kills) < 3 or sum(k.during_save is not None for k in kills) < SAVE_KILLS:
        crash.fail(f"expected >= 3 kills, >= {SAVE_KILLS} of them verified during a save")
    final = crash.processes[-1]
    if not any(line.startswith(f"Finished step {MAX_STEPS}") for _, line in final.lines):
        crash.fail("the final run did not report finishing", final)
    for i, proc in enumerate(crash.processes[:-1], start=1):
        assert proc.killed and proc.proc.returncode == -signal.SIGKILL, (i, proc.proc.returncode, proc.output())

    expected, expected_meta, expected_step = _final_state(backend, reference_dir)
    actual, actual_meta, actual_step = _final_state(backend, crash_dir)
    context = "\n".join(crash.log + [k.describe() for k in kills])
    assert expected_step == actual_step == MAX_STEPS, context
    assert actual_meta == expected_meta, context
    expected_leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    actual_leaves = jax.tree_util.tree_flatten_with_path(actual)[0]
    assert [p for p, _ in expected_leaves] == [p for p, _ in actual_leaves], context
    assert len(expected_leaves) > 10
    for (path, x), (_, y) in zip(expected_leaves, actual_leaves):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (jax.tree_util.keystr(path), context)
        assert np.array_equal(x, y), f"{jax.tree_util.keystr(path)} differs after the crashes\n{context}"

    # Every step logged exactly once, even though killed runs logged steps that were redone.
    steps = [r["step"] for r in read_jsonl_metrics(crash_dir / "metrics.jsonl")]
    duplicated = sorted({s for s in steps if steps.count(s) > 1})
    assert not duplicated, f"metrics.jsonl repeats steps {duplicated}: {steps}\n{context}"
    assert steps == list(range(1, MAX_STEPS + 1)), f"{steps}\n{context}"
