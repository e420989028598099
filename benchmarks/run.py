"""Runs the benchmarks: `python -m benchmarks.run [--smoke] [--only NAME ...] [--results-dir DIR]`.

Each benchmark module `benchmarks/<name>.py` exposes `run(smoke) -> dict` (optionally
taking `results_dir`) and writes `<results>/<name>.json` with the machine description.
After them the runner writes `<results>/SUMMARY.md`: one table of the headline rows of
every `<name>.json` in the results folder (so a partial `--only` run keeps the other
benchmarks' latest rows), with targets and PASS / MISS.

A result's headline rows are its `headlines` list of
`{"metric", "value", "target"?, "passed"?}`, else one row per entry of its `targets`
mapping (`{key: {"value", "target", "met", "metric"?}}`), else a single row from its
`target` and `met` fields, if it has them.

Full runs write to `benchmarks/results/`. Smoke runs (few steps, tiny models; the
numbers mean nothing) write to a fresh temporary folder unless `--results-dir` is
given, and compile with `--xla_backend_optimization_level=0` (added to XLA_FLAGS
unless XLA_FLAGS already sets it), which more than halves XLA:CPU compile times and
leaves what runs the same.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback
from typing import Any

# In running order. The last three belong to a sibling effort; a missing module is skipped with a note.
BENCHMARKS = [
    "step_time", "utilization", "memory", "compile_time", "startup", "checkpoint_io", "checkpoint_blocking",
    "dispatch_overlap", "recovery_latency", "decode_speed", "first_step", "data_wait",
]
OPTIONAL = {"compile_time", "startup", "checkpoint_io", "recovery_latency"}
SMOKE_XLA_FLAG = "--xla_backend_optimization_level=0"


def _load(name: str):
    """The module `benchmarks.<name>`, or None if that module itself does not exist."""
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"benchmarks.{name}" and name in OPTIONAL:
            return None
        raise


def run_one(module, smoke: bool, results_dir: pathlib.Path) -> dict[str, Any]:
    """Calls `module.run(smoke)`, sending its result file to `results_dir`."""
    from benchmarks import common

    if "results_dir" in inspect.signature(module.run).parameters:
        return module.run(smoke, results_dir=results_dir)
    # A run(smoke) that calls write_result without results_dir writes to common.RESULTS.
    saved = common.RESULTS
    common.RESULTS = results_dir
    try:
        return module.run(smoke)
    finally:
        common.RESULTS = saved


def _cell(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def headline_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary rows of one result (see the module docstring)."""
    if isinstance(result.get("headlines"), list):
        return result["headlines"]
    if isinstance(result.get("targets"), dict):
        return [
            {
                "metric": f"{key} ({t['metric']})" if "metric" in t else key,
                "value": t.get("value"),
                "target": t.get("target", ""),
                "passed": bool(t.get("met")),
            }
            for key, t in result["targets"].items()
        ]
    if "target" in result and "met" in result:
        return [{"metric": "target", "value": "see JSON", "target": result["target"], "passed": result["met"]}]
    return [{"metric": "(no headline rows)", "value": f"see {result.get('benchmark', '?')}.json"}]


def write_summary(results_dir: pathlib.Path, notes: list[str]) -> pathlib.Path:
    """`SUMMARY.md` from every `<name>.json` in `results_dir`, in BENCHMARKS order."""
    results = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            notes.append(f"{path.name} is not valid JSON; left out.")
            continue
        if isinstance(data, dict) and "machine" in data:
            results[path.stem] = data
    order = sorted(results, key=lambda n: (BENCHMARKS.index(n) if n in BENCHMARKS else len(BENCHMARKS), n))
    machines = {json.dumps(r["machine"], sort_keys=True) for r in results.values()}
    lines = ["# Benchmark summary", ""]
    if results:
        m = results[order[0]]["machine"]
        lines.append(
            f"Machine: {m.get('cpu_model')}, {m.get('cores')} cores, backend {m.get('backend')} "
            f"({m.get('device_kind')} x{m.get('device_count')}), JAX {m.get('jax_version')}, Python {m.get('python')}."
        )
        if len(machines) > 1:
            lines.append("Warning: the results below come from more than one machine; see each JSON file.")
    smoke = [name for name in order if results[name].get("smoke")]
    if smoke and len(smoke) == len(order):
        lines.append("Smoke mode (tiny models, few steps, XLA optimization level 0): the numbers mean nothing.")
    elif smoke:
        lines.append(f"Rows marked (smoke) come from smoke runs ({', '.join(smoke)}): their numbers mean nothing.")
    lines += ["", "| benchmark | metric | value | target | result | measured (UTC) |", "|---|---|---|---|---|---|"]
    for name in order:
        result = results[name]
        for row in headline_rows(result):
            verdict = "" if "passed" not in row else ("PASS" if row["passed"] else "MISS")
            lines.append(
                f"| {name} | {_cell(row.get('metric', ''))} | {_cell(row.get('value', ''))} | "
                f"{_cell(row.get('target', ''))} | {verdict} | {result.get('time', '')}"
                f"{' (smoke)' if result.get('smoke') else ''} |"
            )
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    path = results_dir / "SUMMARY.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="few steps on tiny models (CI); the numbers mean nothing")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=BENCHMARKS, help="run only these benchmarks")
    parser.add_argument("--results-dir", type=pathlib.Path, help="where JSON and SUMMARY.md go")
    args = parser.parse_args(argv)
    if args.smoke and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAG}".strip()
    from benchmarks.common import RESULTS

    if args.results_dir is not None:
        results_dir = args.results_dir
    elif args.smoke:
        results_dir = pathlib.Path(tempfile.mkdtemp(prefix="axcore-bench-smoke-"))
    else:
        results_dir = RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    notes, failed = [], []
    for name in args.only or BENCHMARKS:
        module = _load(name)
        if module is None:
            notes.append(f"benchmarks/{name}.py is not present; {name} was skipped.")
            print(f"[{name}] skipped: benchmarks/{name}.py is not present", file=sys.stderr)
            continue
        print(f"[{name}] running{' (smoke)' if args.smoke else ''} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            run_one(module, args.smoke, results_dir)
        except Exception:  # One broken benchmark must not hide the others' results.
            traceback.print_exc()
            failed.append(name)
            notes.append(f"{name} FAILED in this run (traceback on stderr); an older {name}.json may be shown.")
        print(f"[{name}] {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    summary = write_summary(results_dir, notes)
    print(summary.read_text())
    print(f"Results: {results_dir}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
