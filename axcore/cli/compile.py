"""`axcore compile`: lower and compile the train step ahead of time, without training.

The train step is lowered on abstract inputs (ShapeDtypeStructs carrying the state's
and the batch's shardings), so nothing is allocated: a Llama-70B-shaped experiment
compiles on a CPU-only machine (e.g. with 8 forced host devices). The report:

- `parameters`: exact, from the parameters' abstract shapes.
- Per-device bytes from `compiled.memory_analysis()`: arguments, outputs,
  temporaries, aliased (donated state buffers reused for the outputs), generated
  code, and the estimated peak = arguments + outputs + temporaries - aliased.
- FLOPs. `xla_flops_per_device` is XLA's `cost_analysis()` of the compiled
  (SPMD-partitioned, hence per-device) step; XLA counts a while loop's body once,
  so a scanned layer stack (`repeated_transformer`) is counted as one layer. If the
  step has a while loop, `flops_per_device` corrects it: the step is compiled again
  with `num_layers` = u and 2u (u = layers per scanned unit), every scan fully
  unrolled and a chunked loss (`model.loss_chunk_len`) in one chunk, giving
  flops(L) = a + b*L (a: embedding, head, loss, optimizer of the
  rest; b: one layer's forward, backward and update), evaluated at the real L.
  Without a while loop the XLA figure is already exact and is used as is.
  `flops_per_step` = `flops_per_device` x devices (replicated work, such as a
  data-parallel optimizer update, counts once per device).
- `model_flops_per_step`, analytical and independent of XLA (dense causal LMs):
  6 * N_matmul * tokens + 12 * L * H * h * T * tokens, with N_matmul the parameters
  used in matmuls (all but the input embedding table when the head is untied), H
  query heads of size h, T = seq_len and tokens = batch * T. The second term is the
  attention score and value matmuls over the full T x T score matrix (as the XLA
  reference kernel computes it under the causal mask; PaLM's appendix-B count); a
  causal kernel that skips masked blocks needs half of it. `flops_ratio` =
  flops_per_step / model_flops_per_step: about 1 for a dense decoder, about 1.27
  with the layers rematerialized (the forward runs twice), below 1 for a mixture of
  experts (N_matmul counts every expert, a token uses top_k of them).
- `pipeline_bubble`: for a layer stack pipelined over the mesh's `stage` axis
  (`axcore.layers.pipeline`), the idle fraction of its schedule's slots, e.g.
  (S-1)/(M+S-1) for GPipe. Idle slots still compute (on discarded data), so the
  corrected FLOPs of a pipelined step are about 1 / (1 - bubble) times the dense
  count; the correction's unrolled compiles use a multiple of stages x repeats
  layers (the fewest the stack splits into) and unroll the schedule's loop too.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from typing import Any

import jax

from axcore.errors import AxcoreError
from axcore.experiment.loading import Experiment, load_experiment
from axcore.layers.pipeline import STAGE_AXIS, pipeline_plans
from axcore.platform.sharding import resolve_mesh_shape
from axcore.plugin.commands import overrides

DEVICE_MEMORY_FLAG = "--device-memory"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# A `while` instruction in optimized HLO text.
_WHILE = re.compile(r"\swhile\(")
_MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")


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


def parameter_counts(experiment: Experiment) -> dict[str, int]:
    """Parameter counts from the model's parameter specs (nothing allocated, nothing compiled).

    Returns `total` (every leaf), `non_trainable` (kernel state and parameters frozen by
    `trainer.learner.trainable`) and `embedding`
    (the input token table, counted only when the head is untied: a lookup, not a matmul).
    """
    from axcore.params import ParameterSpec
    from axcore.trainer.learner import restrict_trainable

    model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
    # Frozen by `trainer.learner.trainable` counts as non-trainable, as the TrainStep does.
    specs = restrict_trainable(model.parameter_specs(), experiment.config.trainer.learner.trainable)
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, ParameterSpec))
    untied = isinstance(specs, dict) and "lm_head" in specs and "embedding" in specs
    table = jax.tree.leaves(specs["embedding"], is_leaf=lambda x: isinstance(x, ParameterSpec)) if untied else []
    return {
        "total": sum(math.prod(s.shape) for s in leaves),
        "non_trainable": sum(math.prod(s.shape) for s in leaves if not s.trainable),
        "embedding": sum(math.prod(s.shape) for s in table),
    }


def model_flops(experiment: Experiment, counts: dict[str, int] | None = None) -> dict[str, Any] | None:
    """Analytical FLOPs of one train step of a dense causal LM (formula in the module docstring).

    Returns None when the model has no `num_layers`/attention to read the shape from.
    All layers are assumed to have the first attention layer's heads and head size.
    """
    from axcore.config.traversal import find
    from axcore.layers.attention import MultiheadAttention

    cfg = experiment.config
    attentions = find(cfg.model, MultiheadAttention)
    if "num_layers" not in cfg.model.keys() or not attentions:
        return None
    counts = counts or parameter_counts(experiment)
    attention = attentions[0][1]
    heads = attention.num_heads
    head_dim = attention.head_dim or cfg.model.dim // heads
    layers, seq = cfg.model.num_layers, cfg.input.seq_len
    tokens = cfg.input.batch_size * seq
    matmul_params = counts["total"] - counts["non_trainable"] - counts["embedding"]
    dense = 6 * matmul_params * tokens
    attention_flops = 12 * layers * heads * head_dim * seq * tokens
    return {
        "formula": "6*N_matmul*tokens + 12*L*H*h*T*tokens",
        "matmul_params": matmul_params, "dense": dense, "attention": attention_flops,
        "total": dense + attention_flops, "tokens": tokens,
    }


@dataclasses.dataclass
class CompiledStep:
    """What one abstract compile of the train step gave."""

    # XLA's cost_analysis FLOPs per device (None if the backend gives none).
    flops: float | None
    # memory_analysis fields in bytes per device (empty if the backend gives none).
    memory: dict[str, int]
    # Number of while loops left in the optimized HLO.
    while_loops: int
    lower_seconds: float
    compile_seconds: float
    devices: int
    mesh: dict[str, int]


def compile_step(experiment: Experiment) -> CompiledStep:
    """Lowers and compiles the experiment's train step (`axcore.trainer.step.TrainStep`) on abstract inputs
    (no allocation)."""
    from axcore.trainer.step import TrainStep  # Deferred: heavy imports.

    train_step = TrainStep(experiment)
    t0 = time.perf_counter()
    lowered = train_step.compiled_train_step().lower(train_step.abstract_state(), train_step.abstract_batch())
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # Older JAX returned one dict per device.
        cost = cost[0] if cost else {}
    stats = compiled.memory_analysis()
    memory = {}
    if stats is not None:
        for field in _MEMORY_FIELDS:
            value = getattr(stats, f"{field}_size_in_bytes", None)
            if value is not None:
                memory[field] = int(value)
    return CompiledStep(
        flops=float(cost["flops"]) if cost and "flops" in cost else None,
        memory=memory,
        while_loops=len(_WHILE.findall(compiled.as_text() or "")),
        lower_seconds=t1 - t0,
        compile_seconds=t2 - t1,
        devices=train_step.mesh.devices.size,
        mesh=dict(zip(train_step.mesh.axis_names, train_step.mesh.devices.shape)),
    )


def layers_per_unit(experiment: Experiment) -> int:
    """Layers per scanned unit: the lcm over the model's repeated_transformer stacks (1 if none); a pipelined
    stack's unit is stages x repeats of them (the fewest layers it can split into its stages)."""
    from axcore.config.traversal import find
    from axcore.layers.transformer import RepeatedTransformer

    stages = mesh_axes(experiment).get(STAGE_AXIS, 1)
    units = [1]
    for _, stack in find(experiment.config.model, RepeatedTransformer):
        unit = stack.layer
        layers = unit.num_layers if "num_layers" in unit.keys() and isinstance(unit.num_layers, int) else 1
        if stack.pipeline is not None and stages > 1:
            layers *= stages * stack.pipeline.instantiate().repeats
        units.append(layers)
    return math.lcm(*units)


def mesh_axes(experiment: Experiment) -> dict[str, int]:
    """Mesh axis name -> size of the experiment's mesh over JAX's devices."""
    mesh = experiment.config.mesh
    shape = resolve_mesh_shape(mesh.mesh_shape, jax.device_count())
    return dict(zip(mesh.mesh_axis_names, shape))


def with_layers(experiment: Experiment, num_layers: int) -> Experiment:
    """The experiment with `model.num_layers = num_layers`, every scanned stack fully unrolled, and a chunked
    loss (`loss_chunk_len`) in one chunk: its scan of one step leaves no loop, so every chunk of the head is
    counted (XLA then merges the backward's recomputation of the logits with the forward: the head's
    forward is counted once, as without chunks)."""
    from axcore.config.traversal import replace
    from axcore.layers.transformer import RepeatedTransformer

    model = replace(
        experiment.config.model, RepeatedTransformer, lambda _, stack: stack.set(unroll=num_layers),
        allow_no_match=True,
    )
    model.num_layers = num_layers
    if "loss_chunk_len" in model.keys() and model.loss_chunk_len is not None:
        model.loss_chunk_len = experiment.config.input.seq_len
    return dataclasses.replace(experiment, config=experiment.config.clone(model=model))


def scan_corrected_flops(experiment: Experiment) -> dict[str, Any]:
    """Per-device FLOPs with scanned layers counted per layer: a + b*L from unrolled compiles at L = u, 2u.

    Raises AxcoreError if the model has no `num_layers` or XLA gives no FLOP count.
    """
    cfg = experiment.config
    if "num_layers" not in cfg.model.keys():
        raise AxcoreError(f"cannot correct scanned-layer FLOPs: {type(cfg.model).__qualname__} has no num_layers.")
    unit = layers_per_unit(experiment)
    small = [compile_step(with_layers(experiment, n * unit)) for n in (1, 2)]
    if any(step.flops is None for step in small):
        raise AxcoreError("cannot correct scanned-layer FLOPs: XLA's cost analysis gave no FLOP count.")
    per_layer = (small[1].flops - small[0].flops) / unit
    fixed = small[0].flops - per_layer * unit
    return {
        "flops": fixed + per_layer * cfg.model.num_layers,
        "fixed": fixed,
        "per_layer": per_layer,
        "layers": (unit, 2 * unit),
        "inner_while_loops": small[1].while_loops,
        "seconds": sum(s.lower_seconds + s.compile_seconds for s in small),
    }


def compile_report(experiment: Experiment) -> dict[str, Any]:
    """Compiles the experiment's train step on abstract inputs and reports its cost.

    Returns a flat dict (see the module docstring for each figure); `notes` maps a key
    to the explanation `format_report` prints beside it. Nothing is allocated.
    """
    cfg = experiment.config
    counts = parameter_counts(experiment)
    step = compile_step(experiment)
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
        mem = step.memory
        peak = mem.get("argument", 0) + mem.get("output", 0) + mem.get("temp", 0) - mem.get("alias", 0)
        report["peak_bytes_per_device"] = peak
        notes["peak_bytes_per_device"] = f"{format_bytes(peak)}; estimated = argument + output + temp - alias"
    if step.flops is not None:
        report["xla_flops_per_device"] = int(step.flops)
        notes["xla_flops_per_device"] = (
            f"{format_count(step.flops)}; XLA cost_analysis, a while loop's body counted once"
        )
        flops, how = step.flops, "no while loop: the XLA figure"
        if step.while_loops:
            fix = scan_corrected_flops(experiment)
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
    analytic = model_flops(experiment, counts)
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
