"""Does the loader keep up? `data_wait` as a share of step time on the default model (issue 22).

Runs `axcore train default` (the embedded corpus, first-fit packing with segment ids,
the background loader) for `--steps` steps with `trainer.log_every=10`, and reads the
trainer's own `train/data_wait_fraction` (time the loop waited for its next batch / step
time) of every logging interval from the run's metrics.jsonl. The first interval holds
the first step's dispatch and is reported apart; the target is on the median of the
others: under 2% of step time. `--packing` compares other packings.

    python -m benchmarks.data_wait [--steps 100] [--packing first_fit]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.common import summarize, write_result

NAME = "data_wait"
# data_wait / step time must stay below this.
TARGET = 0.02
# Smoke mode's model: small enough that 20 steps take seconds (the numbers mean little there anyway).
SMOKE_OVERRIDES = ["model.dim=64", "model.num_layers=1", "model.decoder.layer.feed_forward.hidden_dim=128",
                   "input.seq_len=64", "model.position_embedding.max_len=64"]


def train_once(steps: int, packing: str, run_dir: pathlib.Path, extra: list[str] = ()) -> list[dict]:
    """The metrics records of one `axcore train default` run of `steps` steps (`extra`: more overrides)."""
    from axcore.observe import read_jsonl_metrics

    overrides = [
        f"trainer.max_steps={steps}", "trainer.log_every=10", "trainer.eval_every=0", f"trainer.run_dir={run_dir}",
        "trainer.checkpoint.every_n_steps=0", "trainer.sample.num_tokens=0", f"input.packing={packing}",
        "trainer.metrics_writers=[{type: jsonl}]", *extra,
    ]
    command = [sys.executable, "-m", "axcore.cli", "train", "default", *[a for o in overrides for a in ("--set", o)]]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return read_jsonl_metrics(run_dir / "metrics.jsonl")


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, *, steps: int | None = None,
        packing: str = "first_fit") -> dict[str, Any]:
    """Trains once, writes data_wait.json; returns the result."""
    steps = steps or (20 if smoke else 100)
    with tempfile.TemporaryDirectory(prefix="axcore-data-wait-") as tmp:
        records = train_once(steps, packing, pathlib.Path(tmp) / "run", SMOKE_OVERRIDES if smoke else [])
    intervals = [r for r in records if "train/data_wait_fraction" in r]
    first, rest = intervals[0], intervals[1:] or intervals
    fractions = [r["train/data_wait_fraction"] for r in rest]
    waits = [r["train/data_wait"] for r in rest]
    step_times = [r["train/step_time"] for r in rest]
    efficiency = [r["data/packing_efficiency"] for r in rest if "data/packing_efficiency" in r]
    median = summarize(fractions)["median"]
    data = {
        "smoke": smoke,
        "setup": {"experiment": "default", "steps": steps, "packing": packing, "log_every": 10,
                  "overrides": SMOKE_OVERRIDES if smoke else []},
        "first_interval": {"data_wait_fraction": first["train/data_wait_fraction"], "step_time_s": first["train/step_time"]},
        "data_wait_fraction": summarize(fractions),
        "data_wait_s": summarize(waits),
        "step_time_s": summarize(step_times),
        "packing_efficiency": summarize(efficiency) if efficiency else None,
        "targets": {
            "data_wait_fraction": {
                "target": f"< {TARGET:.0%} of step time",
                "value": median,
                "metric": f"median data_wait / step time per 10-step interval, default model, packing {packing}",
                "met": median < TARGET,
            }
        },
    }
    write_result(NAME, data, results_dir=results_dir)
    print(
        f"data_wait: median {median:.2%} of step time (max {max(fractions):.2%}; "
        f"{summarize(waits)['median'] * 1e3:.2f} ms of {summarize(step_times)['median'] * 1e3:.0f} ms per step; "
        f"first interval {first['train/data_wait_fraction']:.2%}); packing {packing}, efficiency "
        f"{summarize(efficiency)['median'] if efficiency else float('nan'):.3f}; target < {TARGET:.0%}: "
        f"{'met' if median < TARGET else 'MISSED'}"
    )
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_wait", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 100; --smoke 20)")
    parser.add_argument("--packing", default="first_fit", help="input.packing (first_fit, best_fit, concat, none)")
    parser.add_argument("--smoke", action="store_true", help="a short run; the numbers mean little")
    args = parser.parse_args(argv)
    run(args.smoke, steps=args.steps, packing=args.packing)


if __name__ == "__main__":
    main()
