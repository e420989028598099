"""Why does a step call block on the GPU? The trainer's own loop, timed and traced (issue 27, item 2).

    python -m benchmarks.gpu_dispatch [--layers L ...] [--steps 41] [--log-every 10]
    python -m benchmarks.gpu_dispatch --smoke      # tiny model on CPU (CI); numbers mean nothing

Runs the real `Trainer.run` on `benchmarks.gpu_step`'s model (default: the 0.89B shape)
with the `default` experiment's data, `--log-every` steps between metric fetches, and
records for every step call the host time it took to return, and for every batch the
time the loop waited for the device loader (`DeviceLoader.__next__`). Reported as in
`benchmarks.dispatch_overlap`: the dispatch span of an interval (first call's start to
last call's return) over the interval (to the next interval's first call), median over
the intervals after the first; issue 27's target is below 0.1.

To say *where* a blocked call waits, `--trace-calls` step calls (from call
`--trace-from`) run under `jax.profiler`; the host threads' events longer than
`--min-event-ms` are summed by (thread, event name) and the largest listed: a call that
blocks on a transfer, an allocation or an event shows up there by name.
Results: `benchmarks/results/gpu_dispatch.json` (`--tag` adds a suffix) and a printed summary.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import io
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.dispatch_overlap import _RecordedStep
from benchmarks.gpu_step import add_shape_arguments
from benchmarks.llama_jax import LlamaShape


class _TracedStep(_RecordedStep):
    """`dispatch_overlap`'s recording step wrapper, also tracing calls [first, first + count)."""

    def __init__(self, step, trace_dir: str, first: int, count: int):
        super().__init__(step)
        self.trace_dir, self.first, self.count = trace_dir, first, count

    def __call__(self, *args):
        import jax

        index = len(self.calls)
        if self.count and index == self.first:
            jax.profiler.start_trace(self.trace_dir)
        out = super().__call__(*args)
        if self.count and index == self.first + self.count - 1:
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
        return out


def host_events(trace_dir: str, min_ms: float, top: int) -> list[dict[str, Any]]:
    """The longest host-thread events of the trace, summed by (thread, name)."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        return []
    data = ProfileData.from_file(files[0])
    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            for event in line.events:
                ms = event.duration_ns / 1e6
                if ms >= min_ms:
                    entry = totals[(line.name, event.name)]
                    entry[0] += ms
                    entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"thread": t, "event": e, "total_ms": round(ms, 2), "count": n} for (t, e), (ms, n) in ranked]


def driver_calls(trace_dir: str) -> dict[str, dict[str, float]]:
    """CUDA driver calls of the traced step calls, every one however short: {name: {count, total_ms}}.

    How many launches one step makes (`cuLaunchKernel*`, `cuGraphLaunch`) and how long the host
    sat in them tells whether a call blocks because the driver's launch queue is full.
    """
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    calls: dict[str, dict[str, float]] = {}
    for plane in ProfileData.from_file(files[0]).planes if files else ():
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            for event in line.events:
                if event.name.startswith("cu"):
                    entry = calls.setdefault(event.name, {"count": 0, "total_ms": 0.0})
                    entry["count"] += 1
                    entry["total_ms"] = round(entry["total_ms"] + event.duration_ns / 1e6, 3)
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]["total_ms"]))


def measure(args: argparse.Namespace, shape: LlamaShape) -> dict[str, Any]:
    from axcore.data import device_loader
    from axcore.experiment import load_experiment
    from axcore.plugin.loading import installed_entry_points
    from axcore.trainer.trainer import Trainer
    from benchmarks.gpu_step import axcore_overrides

    plugins = ["rope", "swiglu"] + (["gpu"] if "gpu" in installed_entry_points() else [])
    trace_dir = tempfile.mkdtemp(prefix="axcore-dispatch-")
    waits: list[float] = []
    original_next = device_loader.DeviceLoader.__next__

    def timed_next(self):
        start = time.perf_counter()
        item = original_next(self)
        waits.append(time.perf_counter() - start)
        return item

    device_loader.DeviceLoader.__next__ = timed_next
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            settings = [
                *axcore_overrides(shape, args, "auto", plugins),
                f"trainer.run_dir={run_dir}", f"trainer.max_steps={args.steps}", f"trainer.log_every={args.log_every}",
                "trainer.eval_every=0", "trainer.checkpoint.every_n_steps=0", "trainer.sample.num_tokens=0",
                "trainer.learner.learning_rate=3e-4", *args.set,
            ]
            trainer = Trainer(load_experiment("default", settings))
            trainer.stream = trainer.out = io.StringIO()
            compiled, recorded = trainer.step.compiled_train_step, []

            def recording_step():
                recorded.append(_TracedStep(compiled(), trace_dir, args.trace_from, args.trace_calls))
                return recorded[-1]

            trainer.step.compiled_train_step = recording_step
            trainer.run()
            lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
        events = host_events(trace_dir, args.min_event_ms, args.top)
        driver = driver_calls(trace_dir)
    finally:
        device_loader.DeviceLoader.__next__ = original_next
        shutil.rmtree(trace_dir, ignore_errors=True)
    calls, k = recorded[0].calls, args.log_every
    starts = [s for s, _ in calls]
    shares = []
    for first in range(k, len(calls) - k, k):
        last = first + k - 1
        shares.append((calls[last][1] - starts[first]) / (starts[last + 1] - starts[first]))
    step_times = [r["train/step_time"] for r in records[1:]] or [records[0]["train/step_time"]]
    host = [end - start for start, end in calls[1:]]
    return {
        "log_every": k,
        "steps": args.steps,
        "dispatch_span_share_median": statistics.median(shares) if shares else None,
        "host_seconds_per_call_median": statistics.median(host),
        "host_seconds_per_call": [round(x, 5) for x in host],
        "loader_wait_seconds_median": statistics.median(waits[1:]) if len(waits) > 1 else None,
        "loader_wait_seconds": [round(x, 5) for x in waits],
        "trainer_step_time_median_s": statistics.median(step_times),
        "host_events": events,
        "traced_calls": args.trace_calls,
        "driver_calls": driver,
        "cuda_scale_launch_queues": os.environ.get("CUDA_SCALE_LAUNCH_QUEUES"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import write_result
    from benchmarks.gpu_step import shape_of

    shape = shape_of(args)
    result = {"smoke": args.smoke, "model": dataclasses.asdict(shape), "set": args.set, **measure(args, shape)}
    write_result("gpu_dispatch" + (f"_{args.tag}" if args.tag else ""), result, results_dir=args.results_dir)
    share = result["dispatch_span_share_median"]
    print(
        f"dispatch span / interval {share if share is None else round(share, 3)}; host per call "
        f"{1e3 * result['host_seconds_per_call_median']:.2f} ms; loader wait "
        f"{1e3 * (result['loader_wait_seconds_median'] or 0):.2f} ms; step {result['trainer_step_time_median_s']:.4f} s"
    )
    for e in result["host_events"]:
        print(f"  {e['total_ms']:9.2f} ms  x{e['count']:<4} {e['thread'][:40]:40s} {e['event'][:90]}")
    per_call = max(result["traced_calls"], 1)
    for name, e in list(result["driver_calls"].items())[:12]:
        print(f"  driver {name[:40]:40s} {e['count'] / per_call:8.1f} per step call, {e['total_ms'] / per_call:8.2f} ms")
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_dispatch", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (CI)")
    add_shape_arguments(p)
    p.add_argument("--steps", type=int, default=41)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--trace-from", type=int, default=12, help="first traced step call")
    p.add_argument("--trace-calls", type=int, default=4, help="step calls traced (0: no trace)")
    p.add_argument("--min-event-ms", type=float, default=1.0, help="host events shorter than this are ignored")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--set", nargs="*", default=[], help="more experiment overrides (key=value)")
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--tag", help="suffix of the result file's name")
    p.add_argument("--results-dir", type=pathlib.Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.steps, args.log_every, args.trace_from, args.trace_calls = 9, 3, 4, 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
