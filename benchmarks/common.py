"""Shared benchmark helpers: machine description, alternating timing, result files.

Every comparison alternates its contenders in one process (A B A B ...) and reports
medians and the ratio pair by pair, because the machine is shared and noisy.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).parent / "results"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, Python, JAX version, backend and device kind."""
    import jax

    cpu = platform.processor() or "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = jax.devices()[0]
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
    }


def alternate(contenders: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Calls each contender once per round, in turn; each call returns one timing in seconds."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(fn())
    return times


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of `fn()` (the caller blocks on results inside `fn`)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summarize(times: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile, and count."""
    ordered = sorted(times)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": statistics.median(ordered), "p10": pick(0.1), "p90": pick(0.9), "n": len(ordered)}


def step_timer(runner: Any, params: Any, arrays: tuple) -> Callable[[], float]:
    """A contender for `alternate`: wall seconds of one engine `ModelRunner.step(params, *arrays)`, blocked on."""
    import jax

    return lambda: timed(lambda: jax.block_until_ready(runner.step(params, *arrays)))


def runner_benchmark_args(prog: str, doc: str, argv: list[str] | None) -> Any:
    """The arguments of a benchmark of two engine runners: RUN_DIR, or --smoke (a tiny random model); --rounds;
    --json."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("run_dir", nargs="?")
    parser.add_argument("--rounds", type=int, default=7, help="timed calls per contender and shape, alternated")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, 2 rounds, small shapes")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.run_dir is None and not args.smoke:
        parser.error("give RUN_DIR or --smoke")
    return args


def compare_runners(contenders: Sequence[tuple[str, Any]], params: Any, arrays: tuple, rounds: int,
                    ops: Sequence[str]) -> dict[str, Any]:
    """Two engine `ModelRunner`s on one step: each runs it once (compiling; the kernels each chose for `ops`
    are recorded), then `rounds` timed calls alternated. -> per contender `milliseconds`, `kernels` (name ->
    op -> kernel names), `ratio_default_over_xla` (second median / first) and `logits_max_abs_diff`."""
    import numpy as np

    from axcore.kernels import record_kernel_choices

    logits, chosen = {}, {}
    for name, runner in contenders:
        with record_kernel_choices() as choices:
            logits[name] = np.asarray(runner.step(params, *arrays))  # Compiles (traces: records the kernels).
        chosen[name] = {op: sorted(choices.get(op, {})) for op in ops}
    times = alternate({name: step_timer(runner, params, arrays) for name, runner in contenders}, rounds)
    (first, _), (second, _) = contenders
    entry: dict[str, Any] = {name: milliseconds(t) for name, t in times.items()}
    entry["ratio_default_over_xla"] = entry[second]["median_ms"] / entry[first]["median_ms"]
    entry["kernels"] = chosen
    entry["logits_max_abs_diff"] = float(np.abs(logits[first] - logits[second]).max())
    return entry


def milliseconds(times: list[float]) -> dict[str, float]:
    """Median and 10th/90th percentiles (NumPy's interpolation) of wall seconds, in milliseconds."""
    import numpy as np

    return {"median_ms": 1e3 * float(np.median(times)), "p10_ms": 1e3 * float(np.percentile(times, 10)),
            "p90_ms": 1e3 * float(np.percentile(times, 90))}


def emit_report(report: dict[str, Any], path: str | None) -> None:
    """Prints `report` as JSON (the machine and load average added) and writes it to `path` too, if given."""
    report["machine"] = machine_info()
    report["load_average"] = os.getloadavg()
    text = json.dumps(report, indent=1)
    print(text)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def pairwise_ratio(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Summary of numerator[i] / denominator[i] over alternated rounds."""
    return summarize([a / b for a, b in zip(numerator, denominator)])


def write_result(name: str, data: Mapping[str, Any], *, results_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Writes `<results>/<name>.json` with the machine description added."""
    directory = results_dir or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def decoder_param_shapes(d: int, vocab: int, layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes (`"layer0/attention/wq": (d, d)`, ...) of a plain decoder of width `d`."""
    shapes: dict[str, tuple[int, ...]] = {"embedding": (vocab, d), "final_norm": (d,)}
    for i in range(layers):
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"layer{i}/attention/{name}"] = (d, d)
        shapes[f"layer{i}/ffn/w_in"] = (d, 4 * d)
        shapes[f"layer{i}/ffn/w_out"] = (4 * d, d)
        shapes[f"layer{i}/norm1"] = (d,)
        shapes[f"layer{i}/norm2"] = (d,)
    return shapes


def adamw_like_state(shapes: Mapping[str, tuple[int, ...]], seed: int = 0) -> dict[str, Any]:
    """A train state on the first local device: params, AdamW-like mu/nu of the same shapes
    (float32, standard normal), and an int32 step; nested dicts by the '/' of the paths."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    device = jax.local_devices()[0]

    def tree() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, shape in shapes.items():
            node = out
            *parents, leaf = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = jax.device_put(rng.standard_normal(shape, dtype=np.float32), device)
        return out

    state = {"params": tree(), "opt_state": {"mu": tree(), "nu": tree()}}
    state["step"] = jax.device_put(np.asarray(1000, np.int32), device)
    return jax.block_until_ready(state)


def axcore_command() -> list[str]:
    """The `axcore` console script of this interpreter's environment (else `python -m axcore.cli`)."""
    script = pathlib.Path(sys.executable).parent / "axcore"
    if script.exists():
        return [str(script)]
    found = shutil.which("axcore")
    return [found] if found else [sys.executable, "-m", "axcore.cli"]
