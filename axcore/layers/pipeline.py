"""Pipeline parallelism: a scanned layer stack split into stages over the `stage` mesh axis.

A `RepeatedTransformer` whose config sets `pipeline` (a registered schedule, e.g.
`{type: gpipe, microbatches: 4}` or `{type: circular, microbatches: 4, repeats: 2}`)
runs its stacked layers as a pipeline when the traced mesh (`op_environment`) has a
`stage` axis of size S > 1; on any other mesh it is the plain scan (same numbers).

Layout. Parameters stay in the unsplit stacked layout `[num_units, ...]` (logical axis
`layers`, mapped to `stage` by the default axis rules, so a checkpoint does not depend
on the stage count). At run time the units are viewed as `[V, S, k, ...]`: layer group
`g = v * S + s` (k = num_units / (S * V) consecutive units) belongs to stage s and is
applied on the microbatch's v-th trip around the stages. With V = 1 (GPipe) stage s holds
one contiguous block, exactly its shard of the stored layout; with V > 1 the view costs
one resharding collective per step.

Schedule. A schedule is a table `[T, S, 2]` of `(microbatch, repeat)` per time step and
stage (-1, -1 = idle), built by `PipelineSchedule.table(S)` and checked by
`check_table`: stage s at step t works on what stage s-1 finished at step t-1 (same
repeat), and stage 0 takes microbatch m's repeat v > 0 only after stage S-1 finished
its repeat v-1. Any table with that dataflow runs; a new schedule is a registered
`PipelineSchedule` subclass (hook `axcore_register_pipeline_schedules`), no core edit.
The bubble fraction is `idle slots / all slots` of the table (`bubble_fraction`):
(S-1)/(M+S-1) for GPipe, (S-1)/(V*M+S-1) for circular.

Execution (`run_pipeline`): `jax.shard_map` manual over `stage` only (data, fsdp and
tensor stay automatic, so GSPMD still shards inside a stage); a `lax.scan` over the T
steps; each stage applies its layer group to one microbatch and passes the result
to the next stage with one `jax.lax.ppermute` (stage S-1 -> 0 closes the ring for
circular's later trips, kept in a per-microbatch buffer on stage 0). Idle slots compute
on stale data and their results are discarded (as in GPipe implementations on SPMD).
Reverse mode differentiates through it (ppermute's transpose is the reverse ppermute).

Known limits: the layers' output collection (summaries, auxiliary losses) is not carried
through the pipeline (a layer that records one raises ConfigError); dropout masks are
drawn per microbatch (fold_in of the microbatch index), so they differ from the
unpipelined run's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from axcore.config import ConfigBase, Configurable, Positive
from axcore.config.traversal import find
from axcore.errors import ConfigError

# The mesh axis that pipeline stages are laid out on.
STAGE_AXIS = "stage"


class PipelineSchedule(Configurable):
    """Base of registered pipeline schedules; subclasses implement `table`."""

    class Config(Configurable.Config):
        """Configures PipelineSchedule."""

        # Microbatches the batch is split into (rows i, i + M, ... form microbatch i); divides the batch.
        microbatches: Annotated[int, Positive] = 4

    @property
    def microbatches(self) -> int:
        return self._config.microbatches

    @property
    def repeats(self) -> int:
        """V: trips of every microbatch around the stages (layer groups per stage)."""
        return 1

    def table(self, num_stages: int) -> np.ndarray:
        """`[T, num_stages, 2]` int: `(microbatch, repeat)` each stage works on at each step, -1 = idle."""
        raise NotImplementedError(f"{type(self).__name__} must implement table(num_stages).")

    def problems(self, num_stages: int) -> list[str]:
        """Why this schedule cannot run on `num_stages` stages (empty: it can)."""
        return []


def wavefront_table(num_stages: int, microbatches: int, repeats: int) -> np.ndarray:
    """The table where stage s at step t takes slot j = t - s (repeat j // M, microbatch j % M).

    GPipe (repeats 1) and circular pipelining are this table; T = repeats * M + S - 1.
    """
    slots = repeats * microbatches
    table = np.full((slots + num_stages - 1, num_stages, 2), -1, np.int32)
    for s in range(num_stages):
        for j in range(slots):
            table[j + s, s] = (j % microbatches, j // microbatches)
    return table


class GPipe(PipelineSchedule):
    """GPipe (Huang et al. 2019): all microbatches forward through the stages one after another."""

    def table(self, num_stages: int) -> np.ndarray:
        return wavefront_table(num_stages, self.microbatches, 1)


class Circular(PipelineSchedule):
    """Circular (interleaved) pipelining: V layer groups per stage, each microbatch loops V times.

    Needs microbatches >= stages (a microbatch returns to stage 0 before its next trip).
    """

    class Config(PipelineSchedule.Config):
        """Configures Circular."""

        # V: layer groups per stage (trips of each microbatch around the stages).
        repeats: Annotated[int, Positive] = 2

    @property
    def repeats(self) -> int:
        return self._config.repeats

    def table(self, num_stages: int) -> np.ndarray:
        return wavefront_table(num_stages, self.microbatches, self.repeats)

    def problems(self, num_stages: int) -> list[str]:
        if self.repeats > 1 and self.microbatches < num_stages:
            return [f"microbatches ({self.microbatches}) is below the {num_stages} stages; a circular schedule "
                    f"needs microbatches >= stages"]
        return []


def check_table(table: np.ndarray, num_stages: int, microbatches: int, repeats: int) -> list[str]:
    """Problems of a schedule table (module docstring's dataflow); empty when it runs correctly.

    With that dataflow, stage 0's loop buffer slot of microbatch m is never overwritten
    before it is read: stage S-1 finishes m again only after stage 0 took it again.
    """
    if table.ndim != 3 or table.shape[1:] != (num_stages, 2):
        return [f"table has shape {table.shape}, expected [steps, {num_stages}, 2]"]
    done: dict[tuple[int, int, int], int] = {}  # (stage, microbatch, repeat) -> step.
    for t, row in enumerate(table):
        for s, (m, v) in enumerate(row.tolist()):
            if m < 0:
                continue
            if not (0 <= m < microbatches and 0 <= v < repeats) or (s, m, v) in done:
                return [f"step {t} stage {s}: slot ({m}, {v}) is out of range or repeated"]
            if s > 0 and done.get((s - 1, m, v)) != t - 1:
                return [f"step {t} stage {s}: ({m}, {v}) was not finished by stage {s - 1} at step {t - 1}"]
            if s == 0 and v > 0 and done.get((num_stages - 1, m, v - 1), t) >= t:
                return [f"step {t} stage 0: ({m}, {v}) starts before stage {num_stages - 1} finished repeat {v - 1}"]
            done[(s, m, v)] = t
    missing = microbatches * repeats * num_stages - len(done)
    return [f"{missing} (stage, microbatch, repeat) slots never run"] if missing else []


def bubble_fraction(table: np.ndarray) -> float:
    """Idle slots / all slots of a schedule table (every stage idles equally in a wavefront)."""
    return float(np.mean(table[..., 0] < 0))


def stage_count(mesh: Any) -> int:
    """The size of the mesh's `stage` axis (1 without a mesh or the axis)."""
    if mesh is None or STAGE_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[STAGE_AXIS])


def checked_table(schedule: PipelineSchedule, num_stages: int, num_units: int, where: str) -> np.ndarray:
    """The schedule's table for `num_stages`, after its checks; ConfigError naming `where` otherwise."""
    problems = list(schedule.problems(num_stages))
    groups = num_stages * schedule.repeats
    if num_units % groups:
        problems.append(f"the {num_units} stacked units do not split into {num_stages} stages x "
                        f"{schedule.repeats} repeats; use a multiple of {groups}")
    table = schedule.table(num_stages)
    problems += [] if problems else check_table(table, num_stages, schedule.microbatches, schedule.repeats)
    if problems:
        raise ConfigError(f"{where}: {problems[0]} ({type(schedule).__name__}); change the schedule, "
                          f"the stage count (mesh) or the layer count.")
    return table


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A configured pipeline on a mesh: its schedule's shape and bubble."""

    # Config path of the schedule (e.g. `model.decoder.pipeline`).
    path: str
    # The schedule's class name (e.g. GPipe).
    schedule: str
    # S, M, V and T (steps of the table).
    stages: int
    microbatches: int
    repeats: int
    steps: int
    # Idle slots / all slots of the table.
    bubble: float

    def describe(self) -> str:
        return (f"{self.path}: {self.schedule}, {self.stages} stages x {self.microbatches} microbatches x "
                f"{self.repeats} repeats in {self.steps} steps, bubble {self.bubble:.4f} (idle slots / all slots)")


def pipeline_plans(model: ConfigBase, mesh_axes: Mapping[str, int], prefix: str = "model") -> list[PipelinePlan]:
    """The pipelines a model config runs on a mesh of `mesh_axes` (axis name -> size); none without stages."""
    stages = int(mesh_axes.get(STAGE_AXIS, 1))
    if stages <= 1:
        return []
    plans = []
    for path, cfg in find(model, PipelineSchedule):
        schedule = cfg.instantiate()
        table = schedule.table(stages)
        plans.append(PipelinePlan(f"{prefix}.{path}", type(schedule).__name__, stages, schedule.microbatches,
                                  schedule.repeats, table.shape[0], bubble_fraction(table)))
    return plans


def run_pipeline(
    stage_fn: Callable[[Any, jax.Array, Any, jax.Array], jax.Array],
    params: Any,
    x: jax.Array,
    inputs: Any,
    table: np.ndarray,
    *,
    mesh: Any,
    repeats: int,
    unroll: bool = False,
) -> jax.Array:
    """Runs `stage_fn` over the stages as the schedule `table` says; returns the last stage's outputs.

    Args:
        stage_fn: `(group_params, x, inputs, microbatch) -> y`: one layer group (leaves
            `[k, ...]`) on one microbatch `x [mb, ...]` with its `inputs` (leaves `[mb, ...]`).
        params: the stacked units, leaves `[num_units, ...]`.
        x: microbatches `[M, mb, ...]`.
        inputs: a tree of per-microbatch arrays, leaves `[M, mb, ...]`.
        table: the schedule `[T, S, 2]` (`check_table`).
        mesh: a mesh (or abstract mesh) with a `stage` axis of size S.
        repeats: V, layer groups per stage.
        unroll: unroll the loop over the table's steps (for FLOP counts; see axcore.trainer.compile_analysis).

    Returns:
        `[M, mb, ...]`: every microbatch after all layer groups, replicated over `stage`.
    """
    num_steps, num_stages, _ = table.shape

    def view(p):  # [units, ...] -> [V, S, k, ...]: group v * S + s on stage s.
        return p.reshape(repeats, num_stages, p.shape[0] // (repeats * num_stages), *p.shape[1:])

    grouped = jax.tree.map(view, params)
    ring = [(i, (i + 1) % num_stages) for i in range(num_stages)]
    schedule = jnp.asarray(table)

    dtype = x.dtype

    def body(grouped, x, inputs):
        x = x.astype(dtype)
        grouped = jax.tree.map(lambda p: p[:, 0], grouped)  # This stage's groups: [V, k, ...].
        stage = jax.lax.axis_index(STAGE_AXIS)

        def step(carry, row):
            cur, buf, out = carry
            m, v = row[stage, 0], row[stage, 1]
            mi, vi = jnp.maximum(m, 0), jnp.maximum(v, 0)
            h = jnp.where(stage == 0, buf[mi], cur)
            group = jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, vi, keepdims=False), grouped)
            y = stage_fn(group, h, jax.tree.map(lambda a: a[mi], inputs), mi)
            finished = (stage == num_stages - 1) & (m >= 0) & (v == repeats - 1)
            out = out.at[mi].set(jnp.where(finished, y, out[mi]))
            received = jax.lax.ppermute(y, STAGE_AXIS, ring)
            # Stage 0 keeps what stage S-1 sent for the microbatch's next trip.
            lm, lv = row[num_stages - 1, 0], row[num_stages - 1, 1]
            keep = (stage == 0) & (lm >= 0) & (lv < repeats - 1)
            li = jnp.maximum(lm, 0)
            buf = buf.at[li].set(jnp.where(keep, received, buf[li]))
            return (received, buf, out), None

        init = (jnp.zeros_like(x[0]), x, jnp.zeros_like(x))
        (_, _, out), _ = jax.lax.scan(step, init, schedule, unroll=unroll)
        # Only the last stage holds the outputs: a sum over stages replicates them.
        last = jnp.where(stage == num_stages - 1, out, jnp.zeros_like(out)).astype(jnp.float32)
        return jax.lax.psum(last, STAGE_AXIS)

    param_specs = jax.tree.map(lambda _: P(None, STAGE_AXIS), grouped)
    input_specs = jax.tree.map(lambda _: P(), inputs)
    run = jax.shard_map(
        body, mesh=mesh, in_specs=(param_specs, P(), input_specs), out_specs=P(), axis_names={STAGE_AXIS},
        check_vma=False,
    )
    # The activations cross the shard_map boundary in float32, so that the all-reduces over `stage` there (the
    # outputs' sum, the inputs' gradient) are float32: XLA's CPU all-reduce promotion fails on bfloat16 ones
    # inside a partially manual computation.
    return run(grouped, x.astype(jnp.float32), inputs).astype(dtype)


def split_microbatches(x: jax.Array, microbatches: int, where: str) -> jax.Array:
    """`[batch, ...]` -> `[M, batch / M, ...]`, microbatch i = rows i, i + M, ... (each data shard keeps its rows)."""
    if x.shape[0] % microbatches:
        raise ConfigError(f"{where}: the batch of {x.shape[0]} rows does not split into {microbatches} "
                          f"microbatches; use a batch size that is a multiple of microbatches.")
    return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: `[M, mb, ...]` -> `[M * mb, ...]` in the original row order."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


__all__ = [
    "STAGE_AXIS", "Circular", "GPipe", "PipelinePlan", "PipelineSchedule", "bubble_fraction", "check_table", "checked_table",
    "merge_microbatches", "pipeline_plans", "run_pipeline", "split_microbatches", "stage_count", "wavefront_table",
]
