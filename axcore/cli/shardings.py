"""The sharding dump (`axcore config EXPERIMENT --shardings`): how a run's arrays are laid out.

Nothing is allocated and no devices are needed: the mesh is an `AbstractMesh` of the
experiment's `mesh.mesh_shape` (a -1 is resolved with the device count of
`mesh.instance_type`, e.g. 8 for `cpu-8` or `gpu-h100-8`, else of this machine), the
parameters and optimizer state are abstract (`ParameterSpec`s and `jax.eval_shape` of
the optimizer's init), and their shardings are the ones the Trainer uses
(`axcore.platform.sharding`, `axcore.trainer.step.opt_state_shardings`). So a layout for a
selector bigger than this machine can be checked here.

Output (`format_sharding_report`): a header with the mesh and the axis rules, one line
per batch input and per parameter

    model.decoder.layer0.self_attention.wq: [32, 2, 16] float32 (embed, heads, -) -> P('fsdp', 'tensor', None) (per device [16, 1, 16])

then the optimizer state in summary (how many leaves follow their parameter's
sharding; each other leaf listed) and the bytes per device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from axcore.data.schema import BATCH_SCHEMA
from axcore.params import ParameterSpec
from axcore.platform.mesh import InstanceType
from axcore.platform.sharding import (
    batch_sharding,
    check_batch_size,
    parameter_specs_to_partition,
    path_name,
    resolve_mesh_shape,
    resolve_rules,
)


@dataclasses.dataclass(frozen=True)
class ShardedArray:
    """One array of the run and its sharding."""

    # Dotted path, e.g. "model.embedding.weight" or "opt_state[0].count".
    path: str
    shape: tuple[int, ...]
    dtype: str
    # Logical axis per dim (None entries unnamed); None when not a parameter.
    logical_axes: tuple[str | None, ...] | None
    # PartitionSpec with one entry per dim.
    spec: PartitionSpec
    # Shape of the shard each device holds.
    per_device_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jax.numpy.dtype(self.dtype).itemsize

    @property
    def per_device_nbytes(self) -> int:
        return math.prod(self.per_device_shape) * jax.numpy.dtype(self.dtype).itemsize


@dataclasses.dataclass
class ShardingReport:
    """Shardings of a run's batch, parameters and optimizer state on an abstract mesh."""

    # Mesh axis name -> size.
    mesh: dict[str, int]
    # Resolved logical -> mesh axes (defaults plus the mesh rule's axis_rules).
    axis_rules: dict[str, tuple[str, ...] | None]
    batch: list[ShardedArray]
    params: list[ShardedArray]
    # Optimizer-state leaves sharded like their parameter.
    opt_like_params: list[ShardedArray]
    # The other optimizer-state leaves (replicated: counts, factored statistics).
    opt_other: list[ShardedArray]


def report_mesh(experiment: Any) -> AbstractMesh:
    """The experiment's mesh as an `AbstractMesh` (see the module docstring for -1)."""
    mesh = experiment.config.mesh
    shape = tuple(mesh.mesh_shape)
    if -1 in shape:
        found = InstanceType.parse(mesh.instance_type).count if mesh.instance_type else None
        shape = resolve_mesh_shape(shape, found or jax.device_count())
    return AbstractMesh(tuple(shape), tuple(mesh.mesh_axis_names))


def _array(path: str, shape, dtype, sharding: NamedSharding, axes=None) -> ShardedArray:
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    return ShardedArray(
        path, tuple(shape), str(jax.numpy.dtype(dtype)), axes, PartitionSpec(*spec), tuple(sharding.shard_shape(tuple(shape)))
    )


def sharding_report(experiment: Any) -> ShardingReport:
    """The shardings a Trainer would use for `experiment`, computed abstractly.

    Raises:
        ConfigError: a parameter or the batch does not divide its mesh axes (as the Trainer would).
    """
    from axcore.trainer.learner import build_optimizer, restrict_trainable, trainable_mask  # Deferred: heavy imports.
    from axcore.trainer.step import opt_state_shardings

    cfg = experiment.config
    mesh = report_mesh(experiment)
    rules = resolve_rules(cfg.mesh.axis_rules)
    model = cfg.model.instantiate(name="model", registries=experiment.registries)
    specs = restrict_trainable(model.parameter_specs(), cfg.trainer.learner.trainable)  # As the TrainStep does.
    is_spec = lambda x: isinstance(x, ParameterSpec)  # noqa: E731
    partition = parameter_specs_to_partition(specs, rules, mesh)
    is_partition = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), partition, is_leaf=is_partition)
    params = [
        _array(path_name(path, "model"), s.shape, s.dtype, sharding, s.mesh_axes)
        for (path, s), sharding in zip(
            jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0], jax.tree.leaves(param_shardings)
        )
    ]
    # The batch, as the Trainer places it.
    check_batch_size(cfg.input.batch_size, mesh, rules)
    batch_spec = batch_sharding(mesh, rules)
    shape = (cfg.input.batch_size, cfg.input.seq_len)
    batch = [_array(f"batch.{f.name}", shape, f.dtype, batch_spec) for f in BATCH_SCHEMA.fields]
    # Optimizer state: abstract init, then the Trainer's assignment.
    optimizer, _ = build_optimizer(cfg.trainer.learner, specs, cfg.trainer.max_steps)
    abstract = jax.tree.map(lambda s: s.abstract(), specs, is_leaf=is_spec)
    opt_state = jax.eval_shape(optimizer.init, abstract)
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = opt_state_shardings(opt_state, abstract, param_shardings, trainable_mask(specs), replicated)
    like, other = [], []
    for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(opt_state)[0], jax.tree.leaves(shardings)):
        row = _array(path_name(path, "opt_state"), leaf.shape, leaf.dtype, sharding)
        (other if sharding is replicated else like).append(row)
    return ShardingReport(dict(mesh.shape), rules, batch, params, like, other)


def _axes_text(axes: tuple[str | None, ...] | None) -> str:
    return "" if axes is None else " (" + ", ".join(a or "-" for a in axes) + ")"


def format_array(row: ShardedArray) -> str:
    """`path: [shape] dtype (logical axes) -> P(...) (per device [shape])`."""
    return (
        f"{row.path}: {list(row.shape)} {row.dtype}{_axes_text(row.logical_axes)} -> {row.spec} "
        f"(per device {list(row.per_device_shape)})"
    )


def format_sharding_report(report: ShardingReport) -> str:
    """The report as text (module docstring)."""
    devices = math.prod(report.mesh.values())
    mesh = ", ".join(f"{name}={size}" for name, size in report.mesh.items())
    rules = ", ".join(
        f"{logical} -> {'replicated' if not target else '+'.join(target)}" for logical, target in report.axis_rules.items()
    )
    lines = [
        f"# mesh: {mesh} ({devices} devices; abstract, nothing allocated)",
        f"# axis rules: {rules} (mesh axes absent from the mesh are dropped)",
    ]
    lines += [format_array(row) for row in report.batch + report.params]
    opt = report.opt_like_params + report.opt_other
    lines.append(
        f"opt_state: {len(opt)} leaves, {len(report.opt_like_params)} sharded like their parameter, "
        f"{len(report.opt_other)} replicated:"
    )
    lines += [f"  {format_array(row)}" for row in report.opt_other]

    def total(rows):
        return sum(r.nbytes for r in rows), sum(r.per_device_nbytes for r in rows)

    parts = {"params": report.params, "opt_state": opt, "batch": report.batch}
    sums = {name: total(rows) for name, rows in parts.items()}
    text = ", ".join(f"{name} {per} of {whole}" for name, (whole, per) in sums.items())
    whole = sum(w for w, _ in sums.values())
    per = sum(p for _, p in sums.values())
    lines.append(f"# bytes per device: {text}; total {per} of {whole} ({100 * per / max(whole, 1):.1f}%)")
    return "\n".join(lines) + "\n"
