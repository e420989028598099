"""Memory: peak RSS of a short default `axcore train` run against the plain-JAX step.

Each contender runs N steps in its own subprocess; its peak resident set size is the
`ru_maxrss` that `os.wait4` reports for that child alone (forked from a small launcher
process, since a child's ru_maxrss includes what it inherited before exec):

- `axcore_train`: `python -m axcore.cli train --set trainer.max_steps=N` on the
  default experiment (the whole job: data, eval, checkpoint, TensorBoard, sample);
- `axcore_step`: only axcore's `TrainStep.init_state()` and `compiled_train_step()`
  on corpus batches (this module run as a script), to tell the framework's step
  from the training loop's extras;
- `pure_jax_step`: `python -m benchmarks.pure_jax_model --steps N` (random tokens).

The contenders run in turn, `repeats` times each (smoke runs start `axcore_train` and
`pure_jax_step` only, at once);
the result holds each one's median peak and the ratios axcore / pure JAX. The
default experiment has a learned position table instead of RoPE (131k more
parameters, 0.5 MB); otherwise the model is the pure-JAX one.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import write_result

# Overrides of the smoke-mode (tiny) model, for both axcore contenders.
SMOKE_OVERRIDES = [
    "model.dim=32",
    "model.num_layers=1",
    "model.decoder.layer.feed_forward.hidden_dim=128",
    "input.seq_len=32",
    "input.batch_size=4",
    "trainer.eval_batches=1",
    "trainer.sample.num_tokens=4",
]


def _env() -> dict[str, str]:
    root = str(pathlib.Path(__file__).resolve().parent.parent)  # So `-m benchmarks...` imports from any cwd.
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


# Runs argv[1:] and reports its peak RSS. The measured process is forked from this small
# launcher, not from the (large) benchmark process: a child's ru_maxrss counts the memory
# it inherited before exec, so forking from the runner would report the runner's size.
_LAUNCHER = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); _, s, u = os.wait4(p.pid, 0); "
    "print('PEAK_RSS_KIB', u.ru_maxrss, file=sys.stderr); sys.exit(os.waitstatus_to_exitcode(s))"
)


def peak_rss(cmds: dict[str, list[str]], cwd: pathlib.Path, *, concurrent: bool) -> dict[str, dict[str, Any]]:
    """Runs each command (all at once if `concurrent`, else in turn); -> per name its peak RSS
    (MiB) and, when run alone, its wall seconds. Raises if one fails."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as logs:
        running = []
        for name, cmd in cmds.items():
            log = pathlib.Path(logs) / name
            with log.open("wb") as f:
                proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, *cmd], cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=_env())
            running.append((name, cmd, proc, log, time.perf_counter()))
            if not concurrent:
                out[name] = _wait(*running.pop())
        for item in running:
            out[item[0]] = _wait(*item)
            out[item[0]]["wall_s"] = None  # Ran beside the others.
    return out


def _wait(name: str, cmd: list[str], proc: subprocess.Popen, log: pathlib.Path, start: float) -> dict[str, Any]:
    proc.wait()
    wall = time.perf_counter() - start
    text = log.read_text(errors="replace")
    found = re.findall(r"^PEAK_RSS_KIB (\d+)$", text, re.MULTILINE)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{name}: {' '.join(cmd)} exited {proc.returncode}:\n{text[-2000:]}")
    return {"peak_rss_mib": int(found[-1]) / 1024, "wall_s": wall}


def commands(steps: int, smoke: bool, workdir: pathlib.Path) -> dict[str, list[str]]:
    extra = SMOKE_OVERRIDES if smoke else []
    train_sets = [f"trainer.max_steps={steps}", f"trainer.run_dir={workdir / 'run'}", *extra]
    step_args = ["--smoke"] if smoke else []
    cmds = {
        "axcore_train": [sys.executable, "-m", "axcore.cli", "train", *[a for s in train_sets for a in ("--set", s)]],
        "axcore_step": [sys.executable, "-m", "benchmarks.memory", "--axcore-step", str(steps), *step_args],
        "pure_jax_step": [sys.executable, "-m", "benchmarks.pure_jax_model", "--steps", str(steps), *step_args],
    }
    if smoke:  # Keeps CI's smoke run short: the headline pair only.
        del cmds["axcore_step"]
    return cmds


def run(smoke: bool = False, results_dir: pathlib.Path | None = None) -> dict[str, Any]:
    steps, repeats = (2, 1) if smoke else (20, 2)
    load_start = os.getloadavg()
    samples: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="axcore-memory-") as tmp:
        for i in range(repeats):
            workdir = pathlib.Path(tmp) / str(i)
            workdir.mkdir()
            # Smoke runs start the three at once (peak RSS is per process; only wall time suffers).
            for name, sample in peak_rss(commands(steps, smoke, workdir), workdir, concurrent=smoke).items():
                samples.setdefault(name, []).append(sample)
    peak = {name: statistics.median(s["peak_rss_mib"] for s in runs) for name, runs in samples.items()}
    result = {
        "smoke": smoke,
        "steps": steps,
        "repeats": repeats,
        "commands": {name: " ".join(cmd[1:]) for name, cmd in commands(steps, smoke, pathlib.Path("<tmp>")).items()},
        "peak_rss_mib": peak,
        "runs": samples,
        "load_average_1min": {"start": load_start[0], "end": os.getloadavg()[0]},
        "ratios": {f"{name}/pure_jax_step": peak[name] / peak["pure_jax_step"] for name in peak if name != "pure_jax_step"},
    }
    labels = {"axcore_train": "`axcore train`", "axcore_step": "axcore step alone", "pure_jax_step": "pure-JAX step"}
    result["headlines"] = [
        {"metric": f"peak RSS, {labels[name]}, {steps} steps (MiB)", "value": round(value)} for name, value in peak.items()
    ] + [
        {"metric": f"peak RSS ratio {labels[key.split('/')[0]]} / pure-JAX step", "value": round(ratio, 2)}
        for key, ratio in result["ratios"].items()
    ]
    write_result("memory", result, results_dir=results_dir)
    return result


def axcore_step_only(steps: int, smoke: bool) -> None:
    """Trains `steps` steps with axcore's Trainer state and compiled step only; prints the peak RSS."""
    import resource

    import jax

    from axcore.data import Split
    from axcore.experiment import load_experiment
    from axcore.trainer.trainer import Trainer

    experiment = load_experiment(None, SMOKE_OVERRIDES if smoke else [])
    trainer = Trainer(experiment)
    state = trainer.step.init_state()
    step = trainer.step.compiled_train_step()
    batches = experiment.config.input.make_iterator(Split.TRAIN)
    loss = None
    for _ in range(steps):
        state, metrics = step(state, jax.device_put(next(batches), trainer.step.batch_sharding))
        loss = float(metrics["loss"])
    print(f"loss {loss:.4f} peak_rss_kib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The axcore_step contender of the memory benchmark.")
    parser.add_argument("--axcore-step", type=int, required=True, metavar="STEPS")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    axcore_step_only(args.axcore_step, args.smoke)
