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
from collections.abc import Callable, Mapping
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
