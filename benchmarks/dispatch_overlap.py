"""Dispatch overlap: does the trainer's loop run ahead of the device between metric fetches?

The train loop reads metrics back from the device only every `trainer.log_every` steps
(and at eval, checkpoint and last steps). Between those reads nothing waits for a step
to finish, so the host should dispatch the next steps while the device still runs the
earlier ones. Measured on the real `Trainer.run`: the jitted train step it calls is
wrapped to record when each call starts and returns on the host.

For one interval of k steps between fetches:

    dispatch span = return of the interval's last call - start of its first call
    interval      = start of the next interval's first call - start of this one's

(the interval includes the fetch, the metric writers and the progress line). Without a
per-step host sync the dispatch span is a small part of the interval: the host queued
all k steps, then waited at the fetch. A loop that synced every step would make the span
nearly the whole interval; the contrast run with `log_every: 1` shows that case (one
step per interval, so its span is a single call and its "wait" is the whole step).

Reported: median dispatch span / interval over the intervals after the first (which
traces and compiles), the median host time per call, and the trainer's own step time.
Target: span / interval <= 0.5 with `log_every: 20`.
"""

from __future__ import annotations

import io
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result

NAME = "dispatch_overlap"
TARGET_SPAN_SHARE = 0.5


class _RecordedStep:
    """Calls the jitted step and records (start, return) host times of each call."""

    def __init__(self, step):
        self.step, self.calls = step, []

    def lower(self, *args, **kwargs):
        """The trainer compiles the step ahead of time (its memory check); not a step call."""
        return self.step.lower(*args, **kwargs)

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.step(*args)
        self.calls.append((start, time.perf_counter()))
        return out


def measure(overrides: list[str], log_every: int, max_steps: int) -> dict[str, Any]:
    """Trains `max_steps` steps with the given log interval; the overlap of that run."""
    from axcore.experiment import load_experiment
    from axcore.trainer.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        settings = [
            f"trainer.run_dir={run_dir}",
            f"trainer.max_steps={max_steps}",
            f"trainer.log_every={log_every}",
            "trainer.eval_every=0",
            "trainer.checkpoint.every_n_steps=0",
            "trainer.sample.num_tokens=0",
        ]
        trainer = Trainer(load_experiment("default", [*overrides, *settings]))
        trainer.stream = trainer.out = io.StringIO()
        compiled = trainer.step.compiled_train_step
        recorded: list[_RecordedStep] = []

        def recording_step():
            recorded.append(_RecordedStep(compiled()))
            return recorded[-1]

        trainer.step.compiled_train_step = recording_step
        trainer.run()
        records = [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    calls = recorded[0].calls
    starts = [start for start, _ in calls]
    # Intervals: the calls between two fetches, i.e. log_every calls each.
    shares, waits = [], []
    for first in range(log_every, len(calls) - log_every, log_every):  # Skip the compiling interval.
        last = first + log_every - 1
        interval = starts[last + 1] - starts[first]
        span = calls[last][1] - starts[first]
        shares.append(span / interval)
        waits.append(interval - span)
    step_times = [r["train/step_time"] for r in records[1:]] or [records[0]["train/step_time"]]
    return {
        "log_every": log_every,
        "steps": max_steps,
        "intervals": len(shares),
        "dispatch_span_share_median": statistics.median(shares),
        "host_seconds_per_call_median": statistics.median(end - start for start, end in calls[1:]),
        "wait_at_fetch_median_s": statistics.median(waits),
        "trainer_step_time_median_s": statistics.median(step_times),
    }


def run(smoke: bool = False, results_dir: pathlib.Path | None = None) -> dict[str, Any]:
    overrides = ["model.num_layers=1", "model.dim=64", "input.batch_size=2", "input.seq_len=32"] if smoke else []
    log_every, steps = (4, 13) if smoke else (20, 101)
    overlapped = measure(overrides, log_every, steps)
    synced = measure(overrides, 1, 1 + 3 * log_every // 2 if smoke else 41)
    share = overlapped["dispatch_span_share_median"]
    data = {
        "smoke": smoke,
        "experiment": "default" + (" (smoke: 1 layer, d 64)" if smoke else ""),
        "overlapped": overlapped,
        "fetch_every_step": synced,
        "target": f"dispatch span / interval <= {TARGET_SPAN_SHARE} with log_every {log_every}",
        "met": share <= TARGET_SPAN_SHARE,
        "headlines": [
            {
                "metric": f"dispatch span / interval (log_every {log_every})",
                "value": round(share, 3),
                "target": f"<= {TARGET_SPAN_SHARE}",
                "passed": share <= TARGET_SPAN_SHARE,
            }
        ],
    }
    write_result(NAME, data, results_dir=results_dir)
    return data


if __name__ == "__main__":
    print(json.dumps(run(smoke="--smoke" in sys.argv), indent=2))
