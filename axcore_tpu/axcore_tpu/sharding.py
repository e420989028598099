"""Where an attention kernel of this package may run under a device mesh, and how.

Both TPU attention kernels compute one device's batch rows and heads at a time; under
a multi-device mesh whose input specs shard batch and/or heads they run inside
`jax.shard_map` over those axes. Shardings of the sequence or of head_dim are declined
(splash attention's own sequence sharding needs its mask split per shard, which this
package does not do yet).
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from axcore.kernels import AttentionProblem, Support
from axcore.kernels.attention_sharding import attention_mesh_layout, shard_count


def mesh_layout(problem: AttentionProblem) -> tuple[Support, tuple[PartitionSpec, PartitionSpec] | None]:
    """`axcore.kernels.attention_sharding.attention_mesh_layout`, also declining a batch or kv-head
    count that does not divide the mesh axes sharding it."""
    support, specs = attention_mesh_layout(problem)
    if specs is not None:
        q_spec = specs[0]
        heads, rows = (shard_count(problem.mesh, q_spec[d] if d < len(q_spec) else None) for d in (2, 0))
        if problem.num_kv_heads % heads or problem.batch % rows:
            return Support(
                False,
                f"batch {problem.batch} or num_kv_heads {problem.num_kv_heads} does not divide evenly over the "
                f"mesh axes sharding them",
            ), None
    return support, specs


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
