"""Recovery latency: SIGKILL of `axcore train` to the first completed step after the restart.

Setup: the default experiment with the tiny model of axcore.testing.TINY_OVERRIDES (d=32, 2 layers,
batch 4 x 32 tokens; the crash test's model), `trainer.log_every=1`, a checkpoint
every 5 steps (async), no eval, no sample, `trainer.max_steps=100000` (runs never end).

Contenders: checkpoint backend (orbax, tensorstore) x JAX persistent compilation
cache (`cold`: off, axcore's default; `warm`: a cache directory the killed runs
filled, so the restart loads the compiled train step instead of compiling it).
Rounds alternate the contenders (orbax/cold, tensorstore/cold, orbax/warm,
tensorstore/warm, ...). Each contender has its own run directory and one live
"victim" process at a time: a run that has a committed checkpoint and was paused
(SIGSTOP) at a random moment of its training loop (1-6 steps after its latest
restart's first step, plus 0-100 ms). Its turn: SIGKILL the process group (t=0), reap
it, start the same command again, and stop the clock at the restarted run's first
completed step (its first metrics.jsonl record); the restarted run then trains on to
its next random pause and becomes the next victim. Killing a paused process leaves
the disk as a kill at the pause would (an in-flight save stays uncommitted).

The restart runs `axcore train` through a small wrapper (`--child`) that prints
`[recovery-mark] <name> <unix time>` lines: `exec` (interpreter up, before any
import), `imported` (axcore.cli imported), `jax_imported`, `trainer_ready` (experiment loaded and
`Trainer` constructed: `Trainer.run` entered), `restore_start` / `restore_end`
(around `axcore.trainer.resume.restore_train_state`, which the trainer calls), and each JAX compile event
(`jax.monitoring` durations). Phases:

- compile = the union of the JAX compile events' wall intervals (trace, lower, backend
  compile, or the cache load when warm) up to the first step, wherever they fall (the
  trainer now compiles the train step ahead of time, before restoring; it used to
  compile at the first step);
- restart = kill -> restore_start, less the compile time in it: reaping, process
  start, imports, experiment and Trainer construction, run-directory lock and setup,
  backend and iterator construction, the abstract target state;
- restore = restore_start -> restore_end, less any compile in it (reading and
  verifying the checkpoint);
- first step = restore_end -> first metrics record, less the compile in it: running
  the first step and fetching its metrics;
- total = kill -> first metrics record of the restarted run = the sum of the four.

Timestamps are the processes' wall clocks (`time.time()`, one machine). The machine
is shared: the load average at start and end is recorded.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from axcore.placement.layout import checkpoints_path
from benchmarks.common import summarize, write_result

NAME = "recovery_latency"
BACKENDS = ("orbax", "tensorstore")
CACHES = ("cold", "warm")
MARK = "[recovery-mark]"
EVERY = 5
PROCESS_TIMEOUT_S = 300.0
TINY = [  # axcore.testing.TINY_OVERRIDES.
    "model.dim=32",
    "model.num_layers=2",
    "model.position_embedding.max_len=32",
    "model.decoder.layer.self_attention.num_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=64",
    "input.batch_size=4",
    "input.seq_len=32",
]
SMOKE_XLA_FLAG = "--xla_backend_optimization_level=0"  # As benchmarks/run.py --smoke: halves compile times.
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def overrides(backend: str, run_dir: pathlib.Path) -> list[str]:
    return [
        *TINY,
        f"trainer.run_dir={run_dir}",
        f"trainer.checkpoint.backend={backend}",
        f"trainer.checkpoint.every_n_steps={EVERY}",
        "trainer.max_steps=100000",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.sample.num_tokens=0",
        "trainer.metrics_writers=[{type: jsonl}]",
    ]


# -- the child: `axcore train` with timing marks ------------------------------------------


def _mark(name: str, *extra: Any, t: float | None = None) -> None:
    t = time.time() if t is None else t
    sys.stderr.write(" ".join([MARK, name, repr(t), *map(str, extra)]) + "\n")
    sys.stderr.flush()


def child_main(argv: list[str]) -> int:
    """`axcore train <argv>`, printing the marks described in the module docstring."""
    _mark("exec")
    import axcore.cli

    _mark("imported")
    import jax
    import jax.monitoring

    _mark("jax_imported")

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if event.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
            _mark("event", event, repr(duration))

    jax.monitoring.register_event_duration_secs_listener(on_duration)

    import axcore.trainer.resume as resume
    import axcore.trainer.trainer as trainer_module

    original_restore = resume.restore_train_state

    def restore_train_state(*args: Any, **kwargs: Any):
        _mark("restore_start")
        try:
            return original_restore(*args, **kwargs)
        finally:
            _mark("restore_end")

    resume.restore_train_state = restore_train_state  # The trainer imports it from here when it resumes.
    original_run = trainer_module.Trainer.run

    def run(self):
        _mark("trainer_ready")
        return original_run(self)

    trainer_module.Trainer.run = run
    return axcore.cli.main(["train", "default", *argv])


# -- the parent ---------------------------------------------------------------------------


class Child:
    """One `axcore train` (through the wrapper) in its own process group; stderr lines with arrival times."""

    def __init__(self, backend: str, run_dir: pathlib.Path, env: dict[str, str]):
        argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child"]
        for item in overrides(backend, run_dir):
            argv += ["--set", item]
        self.spawned = time.time()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        self.deadline = time.monotonic() + PROCESS_TIMEOUT_S
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stderr:
            self.lines.append((time.time(), raw.decode(errors="replace").rstrip()))

    def steps(self) -> list[tuple[float, int]]:
        """(arrival time, step) of each progress line."""
        return [(t, int(m.group(1))) for t, line in list(self.lines) if (m := re.match(r"step (\d+)/", line))]

    def wait_for_steps(self, count: int) -> list[tuple[float, int]]:
        while len(steps := self.steps()) < count:
            if self.proc.poll() is not None:
                raise RuntimeError(f"axcore train exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"axcore train ran past {PROCESS_TIMEOUT_S:.0f} s:\n{self.tail()}")
            time.sleep(0.002)
        return steps

    def marks(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, line in self.lines:
            parts = line.split()
            if line.startswith(MARK) and parts[1] != "event":
                out.setdefault(parts[1], float(parts[2]))
        return out

    def events(self) -> list[tuple[float, str, float]]:
        """(end time, event name, duration) of the JAX compile events."""
        out = []
        for _, line in self.lines:
            parts = line.split()
            if line.startswith(MARK) and parts[1] == "event":
                out.append((float(parts[2]), parts[3], float(parts[4])))
        return out

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)

    def tail(self, n: int = 30) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def _committed_steps(backend: str, run_dir: pathlib.Path) -> list[int]:
    directory = checkpoints_path(run_dir)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    if backend == "orbax":
        return sorted(int(n) for n in names if n.isdigit() and (directory / n / "commit_success.txt").exists())
    return sorted(
        int(m.group(1)) for n in names if (m := re.fullmatch(r"step_(\d{8,})", n)) and (directory / n / "COMMITTED").exists()
    )


def _first_record_time(run_dir: pathlib.Path, step: int, after: float) -> float | None:
    """Time of the metrics record of `step` written after `after` (by the restarted run)."""
    path = run_dir / "metrics.jsonl"
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step") == step and record.get("time", 0) >= after:
            found = record["time"]
    return found


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in pathlib.Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


class Contender:
    """One backend x cache setting: its run directory and its paused victim process."""

    def __init__(self, backend: str, cache: str, root: pathlib.Path, cache_dir: pathlib.Path, rng: random.Random,
                 smoke: bool = False):
        self.backend, self.cache, self.rng = backend, cache, rng
        self.name = f"{backend}/{cache}"
        self.run_dir = root / f"{backend}-{cache}"
        self.env = dict(os.environ)
        self.env.setdefault("JAX_PLATFORMS", "cpu")
        self.env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if cache == "warm":
            self.env.update(
                JAX_ENABLE_COMPILATION_CACHE="true",
                JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
            )
        else:
            self.env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        if smoke and SMOKE_XLA_FLAG.split("=")[0] not in self.env.get("XLA_FLAGS", ""):
            self.env["XLA_FLAGS"] = f"{self.env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAG}".strip()
        self.victim: Child | None = None
        self.samples: list[dict[str, Any]] = []

    def pause_at_random(self, child: Child, after_steps: int) -> None:
        """Lets `child` train 1-6 more steps (and hold a committed checkpoint), then SIGSTOPs it 0-100 ms later."""
        steps = child.wait_for_steps(after_steps + self.rng.randint(1, 6))
        while not [s for s in _committed_steps(self.backend, self.run_dir) if s <= steps[-1][1]]:
            steps = child.wait_for_steps(len(steps) + 1)
        time.sleep(self.rng.uniform(0.0, 0.1))
        child.signal(signal.SIGSTOP)
        self.victim = child

    def prepare(self) -> None:
        """The first victim: a fresh run paused after its first checkpoint."""
        child = Child(self.backend, self.run_dir, self.env)
        try:
            child.wait_for_steps(EVERY + 1)
            self.pause_at_random(child, EVERY + 1)
        except BaseException:
            child.kill()
            raise

    def recover_once(self) -> dict[str, Any]:
        victim, self.victim = self.victim, None
        committed = _committed_steps(self.backend, self.run_dir)
        t_kill = time.time()
        victim.kill()
        t_dead = time.time()
        child = Child(self.backend, self.run_dir, self.env)
        try:
            (t_line, first_step), *_ = child.wait_for_steps(1)
            t_record = _first_record_time(self.run_dir, first_step, child.spawned) or t_line
            marks = child.marks()
            missing = {"exec", "imported", "jax_imported", "trainer_ready", "restore_start", "restore_end"} - set(marks)
            if missing:
                raise RuntimeError(f"marks {sorted(missing)} missing (did the trainer change?):\n{child.tail()}")
            # JAX compile work (trace, lower, backend compile or cache load) as a union of wall intervals,
            # wherever it falls: the trainer compiles the step before restoring, older ones after.
            intervals = _union([(t - d, t) for t, e, d in child.events() if e in COMPILE_EVENTS])
            compile_in = lambda a, b: _overlap(intervals, a, b)  # noqa: E731
            compile_parts = {e.rsplit("/", 1)[1]: 0.0 for e in COMPILE_EVENTS}
            for t, e, d in child.events():
                if e in COMPILE_EVENTS and t <= t_record:
                    compile_parts[e.rsplit("/", 1)[1]] += d
            before = compile_in(t_kill, marks["restore_start"])
            during = compile_in(marks["restore_start"], marks["restore_end"])
            after = compile_in(marks["restore_end"], t_record)
            sample = {
                "restored_step": first_step - 1,
                "latest_committed_at_kill": committed[-1] if committed else None,
                "total_s": t_record - t_kill,
                "restart_s": marks["restore_start"] - t_kill - before,
                "restore_s": marks["restore_end"] - marks["restore_start"] - during,
                "compile_s": before + during + after,
                "first_step_s": t_record - marks["restore_end"] - after,
                "compile_where_s": {"before_restore": before, "during_restore": during, "after_restore": after},
                "compile_event_sums_s": compile_parts,
                "restart_parts_s": {
                    "kill_and_reap": t_dead - t_kill,
                    "spawn_to_interpreter": marks["exec"] - child.spawned,
                    "import_axcore_cli": marks["imported"] - marks["exec"],
                    "import_jax": marks["jax_imported"] - marks["imported"],
                    "experiment_and_trainer": marks["trainer_ready"] - marks["jax_imported"],
                    "run_setup_to_restore_incl_compile": marks["restore_start"] - marks["trainer_ready"],
                },
                "progress_line_after_record_s": t_line - t_record,
            }
            self.samples.append(sample)
            self.pause_at_random(child, 1)
        except BaseException:
            child.kill()
            raise
        return sample

    def close(self) -> None:
        if self.victim is not None:
            self.victim.kill()
            self.victim = None


PHASES = ("total_s", "restart_s", "restore_s", "compile_s", "first_step_s")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(y, b) - max(x, a)) for x, y in intervals)


def _summary(values: list[float]) -> dict[str, float]:
    return {**summarize(values), "min": min(values), "max": max(values)}


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, *, rounds: int | None = None,
        seed: int = 0) -> dict[str, Any]:
    """Alternates the contenders' kill-restart rounds; writes recovery_latency.json."""
    rounds = rounds or (1 if smoke else 5)
    caches = ("warm",) if smoke else CACHES
    backends = BACKENDS[-1:] if smoke else BACKENDS  # Smoke keeps the code running; the crash test covers both.
    rng = random.Random(seed)
    root = pathlib.Path(tempfile.mkdtemp(prefix="axcore-recovery-bench-"))
    cache_dir = root / "jax-cache"
    contenders = [Contender(b, c, root, cache_dir, rng, smoke) for c in caches for b in backends]
    load_before = _loadavg()
    start = time.perf_counter()
    try:
        for contender in contenders:  # Untimed: the first victims (they also fill the warm cache).
            contender.prepare()
        for r in range(rounds):
            for contender in contenders:
                sample = contender.recover_once()
                print(f"[{NAME}] round {r + 1}/{rounds} {contender.name}: total {sample['total_s']:.2f} s "
                      f"(restart {sample['restart_s']:.2f}, restore {sample['restore_s']:.3f}, "
                      f"compile {sample['compile_s']:.2f}, first step {sample['first_step_s']:.2f})",
                      file=sys.stderr, flush=True)
    finally:
        for contender in contenders:
            contender.close()
        shutil.rmtree(root, ignore_errors=True)
    load_after = _loadavg()

    results: dict[str, Any] = {}
    for c in contenders:
        entry = {phase: _summary([s[phase] for s in c.samples]) for phase in PHASES}
        for parts in ("restart_parts_s", "compile_where_s", "compile_event_sums_s"):
            entry[parts] = {part: _summary([s[parts][part] for s in c.samples]) for part in c.samples[0][parts]}
        results[c.name] = entry
    headlines = []
    for c in contenders:
        e = results[c.name]
        headlines.append({
            "metric": f"{c.name}: kill -> first step after restart (median s; min-max)",
            "value": f"{e['total_s']['median']:.2f} ({e['total_s']['min']:.2f}-{e['total_s']['max']:.2f})",
        })
        headlines.append({
            "metric": f"{c.name}: restart / restore / compile / first step (median s)",
            "value": f"{e['restart_s']['median']:.2f} / {e['restore_s']['median']:.3f} / "
                     f"{e['compile_s']['median']:.2f} / {e['first_step_s']['median']:.2f}",
        })
    data = {
        "smoke": smoke,
        "setup": {
            "experiment": "default, tiny model (axcore.testing.TINY_OVERRIDES)",
            "overrides": overrides("<backend>", pathlib.Path("<run_dir>")),
            "rounds": rounds,
            "contenders": [c.name for c in contenders],
            "order": "one untimed first victim per contender, then per round each contender in turn",
            "kill": "SIGKILL of the process group of a run paused (SIGSTOP) 1-6 steps after its restart's "
                    "first step + 0-100 ms, with a committed checkpoint",
            "cache": "cold: JAX_ENABLE_COMPILATION_CACHE=false (axcore's default has no cache dir); warm: "
                     "JAX persistent compilation cache filled by earlier runs",
            "seed": seed,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "wall_s": time.perf_counter() - start,
        },
        "results": results,
        "headlines": headlines,
        "samples": {c.name: c.samples for c in contenders},
    }
    write_result(NAME, data, results_dir=results_dir)
    return data


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2:]))
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.recovery_latency", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one round, warm cache, one backend (seconds); numbers mean nothing")
    parser.add_argument("--rounds", type=int, help="rounds per contender (default 5; smoke 1)")
    parser.add_argument("--results-dir", type=pathlib.Path, help="where recovery_latency.json goes")
    args = parser.parse_args()
    results_dir = args.results_dir
    if results_dir is None and args.smoke:  # Smoke numbers never overwrite benchmarks/results/.
        results_dir = pathlib.Path(tempfile.mkdtemp(prefix="axcore-bench-smoke-"))
    out = run(args.smoke, results_dir, rounds=args.rounds)
    print(f"Results: {results_dir or 'benchmarks/results'}", file=sys.stderr)
    print(json.dumps(out["headlines"], indent=2))
