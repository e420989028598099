"""What compiling the train step ahead of time tells: memory, FLOPs, parameter counts.

The train step is lowered on abstract inputs (ShapeDtypeStructs carrying the state's
and the batch's shardings), so nothing is allocated: a Llama-70B-shaped experiment
compiles on a CPU-only machine (e.g. with 8 forced host devices). `axcore compile`
prints these figures (`axcore.cli.compile` only formats them); the benchmarks and the
trainer's memory check read them from here.

- `parameter_counts`: exact, from the parameters' abstract shapes.
- `CompiledStep.memory`: per-device bytes from XLA's `compiled.memory_analysis()`
  (read by `axcore.trainer.memory_check.memory_analysis`, the one place it is read):
  arguments, outputs, temporaries, aliased (donated state buffers reused for the
  outputs), generated code; `memory_check.estimated_peak` = arguments + outputs +
  temporaries - aliased.
- FLOPs. `CompiledStep.flops` is XLA's `cost_analysis()` of the compiled
  (SPMD-partitioned, hence per-device) step; XLA counts a while loop's body once,
  so a scanned layer stack (`repeated_transformer`) is counted as one layer. If the
  step has a while loop, `scan_corrected_flops` corrects it: the step is compiled again
  with `num_layers` = u and 2u (u = layers per scanned unit), every scan fully
  unrolled and a chunked loss (`model.loss_chunk_len`) in one chunk, giving
  flops(L) = a + b*L (a: embedding, head, loss, optimizer of the
  rest; b: one layer's forward, backward and update), evaluated at the real L.
  Without a while loop the XLA figure is already exact and is used as is.
  Per step = per device x devices (replicated work, such as a data-parallel
  optimizer update, counts once per device).
- `model_flops`, analytical and independent of XLA (dense causal LMs):
  6 * N_matmul * tokens + 12 * L * H * h * T * tokens, with N_matmul the parameters
  used in matmuls (all but the input embedding table when the head is untied), H
  query heads of size h, T = seq_len and tokens = batch * T. The second term is the
  attention score and value matmuls over the full T x T score matrix (as the XLA
  reference kernel computes it under the causal mask; PaLM's appendix-B count); a
  causal kernel that skips masked blocks needs half of it. XLA's count over this one
  is about 1 for a dense decoder, about 1.27 with the layers rematerialized (the
  forward runs twice), below 1 for a mixture of experts (N_matmul counts every
  expert, a token uses top_k of them).
- Pipelines: for a layer stack pipelined over the mesh's `stage` axis
  (`axcore.layers.pipeline`), idle slots still compute (on discarded data), so the
  corrected FLOPs of a pipelined step are about 1 / (1 - bubble) times the dense
  count; the correction's unrolled compiles use a multiple of stages x repeats
  layers (the fewest the stack splits into) and unroll the schedule's loop too.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import TYPE_CHECKING, Any

import jax

from axcore.errors import AxcoreError
from axcore.layers.pipeline import STAGE_AXIS
from axcore.platform.sharding import resolve_mesh_shape
from axcore.trainer.memory_check import memory_analysis, memory_sizes

if TYPE_CHECKING:
    from axcore.experiment.loading import Experiment

# A `while` instruction in optimized HLO text.
_WHILE = re.compile(r"\swhile\(")
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
    # memory_analysis sizes in bytes per device (`memory_sizes`; empty if the backend gives none).
    memory: dict[str, int]
    # Number of while loops left in the optimized HLO.
    while_loops: int
    # Seconds to lower the step to HLO.
    lower_seconds: float
    # Seconds to compile the lowered step.
    compile_seconds: float
    # Devices of the step's mesh.
    devices: int
    # Mesh axis name -> size.
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
    return CompiledStep(
        flops=float(cost["flops"]) if cost and "flops" in cost else None,
        memory=memory_sizes(memory_analysis(compiled)),
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

    Returns `flops` (at the real L), `fixed` (a), `per_layer` (b), `layers` (u, 2u),
    `inner_while_loops` (left in the 2u compile) and `seconds` (both compiles).
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
