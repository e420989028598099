"""Where an attention kernel of this package may run under a device mesh (the sharded call itself is
`axcore.kernels.fused_attention.run_sharded`).

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
