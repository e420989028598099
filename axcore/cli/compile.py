"""`axcore compile`: lower and compile the train step ahead of time, without training, and print its cost.

The figures come from `axcore.trainer.compile_analysis` (how each is computed is in its
module docstring); this module parses the arguments and formats the report, one
`key: value` line per figure:

- `parameters`: exact, from the parameters' abstract shapes.
- `<field>_bytes_per_device` for argument, output, temp, alias, generated_code (XLA's
  `memory_analysis()`), and `peak_bytes_per_device` = argument + output + temp - alias.
- `xla_flops_per_device`: XLA's `cost_analysis()` (a while loop's body counted once);
  `flops_per_device`: the same, scan-corrected when the step has a while loop;
  `flops_per_step` = `flops_per_device` x devices.
- `model_flops_per_step`, analytical (6 * N_matmul * tokens + 12 * L * H * h * T * tokens);
  `flops_ratio` = flops_per_step / model_flops_per_step: about 1 for a dense decoder, about
  1.27 with the layers rematerialized, below 1 for a mixture of experts.
- `pipeline_bubble`: for a layer stack pipelined over the mesh's `stage` axis, the idle
  fraction of its schedule's slots, e.g. (S-1)/(M+S-1) for GPipe.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

from axcore.errors import AxcoreError
from axcore.experiment.loading import Experiment, load_experiment
from axcore.layers.pipeline import pipeline_plans
from axcore.plugin.commands import overrides
from axcore.trainer import compile_analysis
from axcore.trainer.memory_check import estimated_peak

DEVICE_MEMORY_FLAG = "--device-memory"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str = DEVICE_MEMORY_FLAG) -> int:
    """`80GB` (10^9), `80GiB` (2^30), `96e9`, `1024` -> bytes; AxcoreError naming `flag` if malformed."""
    match = _BYTES.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or not 0 < float(match.group(1)) < math.inf:
        raise AxcoreError(
            f"{flag} {text!r} is not a positive size; give bytes like 80GB, 80GiB, 96e9 or 85899345920 "
            f"(units, any case: B; kB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """e.g. `80.86 GB = 75.31 GiB` (decimal, then binary units); below 1 kB, `512 B`."""
    if abs(n) < 1000:
        return f"{n} B"
    decimal = next((u, s) for u, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if abs(n) >= s)
    binary = next((u, s) for u, s in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                  if abs(n) >= s or u == "KiB")
    return f"{n / decimal[1]:.2f} {decimal[0]} = {n / binary[1]:.2f} {binary[0]}"


def _short_bytes(n: int) -> str:
    """e.g. `80.86 GB (75.31 GiB)`."""
    text = format_bytes(n)
    return text.replace(" = ", " (") + ")" if " = " in text else text


def format_count(n: float) -> str:
    """e.g. 6738415616 -> `6.74B`, 1.5e15 -> `1.50P`."""
    for suffix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:g}"


def compile_report(experiment: Experiment) -> dict[str, Any]:
    """Compiles the experiment's train step on abstract inputs and reports its cost.

    Returns a flat dict (see the module docstring for each figure); `notes` maps a key
    to the explanation `format_report` prints beside it. Nothing is allocated.
    """
    cfg = experiment.config
    counts = compile_analysis.parameter_counts(experiment)
    step = compile_analysis.compile_step(experiment)
    report: dict[str, Any] = {
        "experiment": experiment.source,
        "instance_type": cfg.mesh.instance_type,
        "mesh": step.mesh,
        "devices": step.devices,
        "parameters": counts["total"],
        "tokens_per_step": cfg.input.batch_size * cfg.input.seq_len,
        "lower_seconds": round(step.lower_seconds, 3),
        "compile_seconds": round(step.compile_seconds, 3),
    }
    notes = {
        "parameters": format_count(counts["total"])
        + (f", of which {counts['non_trainable']} non-trainable kernel state" if counts["non_trainable"] else ""),
        "tokens_per_step": f"batch {cfg.input.batch_size} x seq {cfg.input.seq_len}",
    }
    if step.memory:
        for field, value in step.memory.items():
            report[f"{field}_bytes_per_device"] = value
            notes[f"{field}_bytes_per_device"] = format_bytes(value)
        peak = estimated_peak(step.memory)
        report["peak_bytes_per_device"] = peak
        notes["peak_bytes_per_device"] = f"{format_bytes(peak)}; estimated = argument + output + temp - alias"
    if step.flops is not None:
        report["xla_flops_per_device"] = int(step.flops)
        notes["xla_flops_per_device"] = (
            f"{format_count(step.flops)}; XLA cost_analysis, a while loop's body counted once"
        )
        flops, how = step.flops, "no while loop: the XLA figure"
        if step.while_loops:
            fix = compile_analysis.scan_corrected_flops(experiment)
            flops = fix["flops"]
            report["correction_seconds"] = round(fix["seconds"], 3)
            how = (
                f"a + b*L at L={cfg.model.num_layers}, from unrolled compiles at L={fix['layers'][0]},"
                f"{fix['layers'][1]}: a={format_count(fix['fixed'])}, b={format_count(fix['per_layer'])} per layer"
            )
            if fix["inner_while_loops"]:
                how += f"; {fix['inner_while_loops']} while loop(s) inside a layer still counted once"
        report["flops_per_device"] = int(flops)
        notes["flops_per_device"] = f"{format_count(flops)}; {how}"
        report["flops_per_step"] = int(flops * step.devices)
        notes["flops_per_step"] = f"{format_count(flops * step.devices)}; flops_per_device x {step.devices} devices"
    for i, plan in enumerate(pipeline_plans(cfg.model, step.mesh)):
        key = "pipeline_bubble" if i == 0 else f"pipeline_bubble_{i}"
        report[key] = round(plan.bubble, 6)
        notes[key] = plan.describe()
    analytic = compile_analysis.model_flops(experiment, counts)
    if analytic is not None:
        report["model_flops_per_step"] = analytic["total"]
        notes["model_flops_per_step"] = (
            f"{format_count(analytic['total'])}; {analytic['formula']} = {format_count(analytic['dense'])} + "
            f"{format_count(analytic['attention'])} (N_matmul {format_count(analytic['matmul_params'])}, "
            f"attention over the full TxT scores; causal-only: {format_count(analytic['attention'] / 2)})"
        )
        if "flops_per_step" in report:
            report["flops_ratio"] = round(report["flops_per_step"] / analytic["total"], 4)
            notes["flops_ratio"] = "flops_per_step / model_flops_per_step"
    report["notes"] = notes
    return report


def format_report(report: dict[str, Any]) -> str:
    """One `key: value` line per figure, its explanation in parentheses after the value."""
    notes = report.get("notes", {})
    lines = []
    for key, value in report.items():
        if key != "notes":
            lines.append(f"{key}: {value}" + (f"  ({notes[key]})" if key in notes else ""))
    return "\n".join(lines) + "\n"


def check_device_memory(report: dict[str, Any], device_memory: int) -> None:
    """Raises AxcoreError if the report's estimated per-device peak exceeds `device_memory` bytes."""
    peak = report.get("peak_bytes_per_device")
    if peak is None:
        raise AxcoreError(f"this backend gives no memory analysis, so {DEVICE_MEMORY_FLAG} cannot be checked.")
    if peak > device_memory:
        raise AxcoreError(
            f"estimated peak {_short_bytes(peak)} per device exceeds {DEVICE_MEMORY_FLAG} {_short_bytes(device_memory)}"
        )


def run(args) -> int:
    """Prints the compile report; with --device-memory, then an AxcoreError (exit 2) if the peak exceeds it."""
    limit = None if args.device_memory is None else parse_bytes(args.device_memory, DEVICE_MEMORY_FLAG)
    experiment = load_experiment(args.experiment, overrides(args), objects=args.objects, apply_xla_flags=True)
    report = compile_report(experiment)
    sys.stdout.write(format_report(report))
    sys.stdout.flush()
    if limit is not None:
        check_device_memory(report, limit)
    return 0
