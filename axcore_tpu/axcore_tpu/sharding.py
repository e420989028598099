"""Where an attention kernel of this package may run under a device mesh, and how.

Both TPU attention kernels compute one device's batch rows and heads at a time; under
a multi-device mesh whose input specs shard batch and/or heads they run inside
`jax.shard_map` over those axes. Shardings of the sequence or of head_dim are declined
(splash attention's own sequence sharding needs its mask split per shard, which this
package does not do yet).
"""

from __future__ import annotations

import math
from typing import Any

from axcore.kernels import SUPPORTED, AttentionProblem, Support
from jax.sharding import PartitionSpec


def _padded(spec: Any) -> tuple[Any, ...]:
    """A `[b, t, n, h]` PartitionSpec as 4 entries (trailing ones None)."""
    entries = tuple(spec)
    return entries + (None,) * (4 - len(entries))


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def shard_count(mesh: Any, entry: Any) -> int:
    """Devices a dimension sharded as `entry` (a mesh axis, a tuple of them or None) is split over."""
    return math.prod(mesh.shape[axis] for axis in _axes(entry))


def mesh_layout(problem: AttentionProblem) -> tuple[Support, tuple[PartitionSpec, PartitionSpec] | None]:
    """Whether the problem's sharding can run, and the `(q_spec, kv_spec)` to shard_map over.

    The specs are None when no shard_map is needed: no mesh, a one-device mesh, or
    inputs replicated over the whole mesh.
    """
    mesh = problem.mesh
    if mesh is None or math.prod(mesh.shape.values()) == 1:
        return SUPPORTED, None
    specs = tuple(problem.input_specs[:3])
    if len(specs) < 3 or any(spec is None for spec in specs):
        return Support(False, "input_specs of q, k, v are unknown under a multi-device mesh"), None
    q_spec, k_spec, v_spec = (_padded(spec) for spec in specs)
    if k_spec != v_spec:
        return Support(False, f"k and v are sharded differently ({k_spec} vs {v_spec})"), None
    for name, spec in (("q", q_spec), ("k", k_spec)):
        if spec[1] is not None:
            return Support(False, f"{name}'s sequence dim is sharded over mesh axes {_axes(spec[1])}"), None
        if spec[3] is not None:
            return Support(False, f"{name}'s head_dim is sharded over mesh axes {_axes(spec[3])}"), None
    if q_spec[0] != k_spec[0]:
        return Support(False, f"q's batch is sharded over {q_spec[0]} but k's over {k_spec[0]}"), None
    if q_spec[2] != k_spec[2]:
        # Sharding query heads but not kv heads (or otherwise) breaks the head -> kv-head grouping.
        return Support(False, f"query heads are sharded over {q_spec[2]} but kv heads over {k_spec[2]}"), None
    heads = shard_count(mesh, q_spec[2])
    if problem.num_kv_heads % heads or problem.batch % shard_count(mesh, q_spec[0]):
        return Support(
            False,
            f"batch {problem.batch} or num_kv_heads {problem.num_kv_heads} does not divide evenly over the "
            f"mesh axes sharding them",
        ), None
    if q_spec[0] is None and q_spec[2] is None:
        return SUPPORTED, None
    return SUPPORTED, (PartitionSpec(*q_spec), PartitionSpec(*k_spec))


def run_sharded(problem: AttentionProblem, specs, attend, q, k, v, *rows):
    """`attend(q, k, v, *rows)`, under `jax.shard_map` over `specs` (from `mesh_layout`) when not None.

    `rows` are `[batch, length]` arrays (segment ids), sharded like q's batch.
    """
    import jax

    if specs is None:
        return attend(q, k, v, *rows)
    q_spec, kv_spec = specs
    row_spec = PartitionSpec(q_spec[0], None)
    in_specs = (q_spec, kv_spec, kv_spec) + (row_spec,) * len(rows)
    # check_vma=False: Pallas interpret mode (the CPU tests) cannot type its grid loop's carry
    # under check_vma=True; one path keeps the tested one the one that runs on a TPU.
    sharded = jax.shard_map(attend, mesh=problem.mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)
    return sharded(q, k, v, *rows)
