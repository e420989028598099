"""A base class for per-device fused attention kernels (cuDNN, Pallas, splash, ...): their shared tail.

Such a kernel computes one device's batch rows and heads at a time. Every one of them
declines, in order, what it does not implement, a sharding its mesh layout declines,
then extras it does not know (`is_supported`); its call refuses the inputs it declines
and runs under `jax.shard_map` over the layout's specs when the mesh shards batch or
heads (`__call__`). A subclass states only what differs:

- `check(problem)`: its own declines (platform, dtype, shapes, features).
- `attend(problem, q, k, v, **rows)`: one device's attention; q `[b, t, n, h]`, k and v
  `[b, s, kv_n, h]`, the result `[b, t, n, h]` like q; `rows` are `[b, length]` arrays by
  name (segment ids, the key mask), sharded like q's batch.
- `rows(problem, q, k, *, kv_mask, q_segment_ids, kv_segment_ids)`: those arrays (default:
  the segment ids, then the key mask, the ones given).
- `mesh_layout(problem)`: the layout (default `attention_mesh_layout`).
- `declined_inputs`: the call's inputs it does not implement (a ValueError when given).
- `check_vma`: shard_map's varying-axes check (Pallas interpret mode, used by the CPU tests,
  cannot type its grid loop's carry under it; one setting keeps the tested path the one that runs).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec

from axcore.kernels.attention import AttentionProblem
from axcore.kernels.attention_sharding import attention_mesh_layout, checked_call_layout
from axcore.kernels.registry import SUPPORTED, Support, unknown_extras

# Inputs of an attention call that fused kernels do not implement (is_supported declines them).
DECLINED_INPUTS = ("q_positions", "kv_positions", "bias", "dropout_key")


def run_sharded(problem: AttentionProblem, specs, attend, q, k, v, *rows, check_vma: bool = False):
    """`attend(q, k, v, *rows)`, under `jax.shard_map` over `specs` (`(q_spec, kv_spec)` of a mesh layout)
    when not None. `rows` are `[batch, length]` arrays (segment ids, key masks), sharded like q's batch;
    mesh axes the specs leave out replicate the call."""
    if specs is None:
        return attend(q, k, v, *rows)
    q_spec, kv_spec = specs
    row_spec = PartitionSpec(q_spec[0], None)
    in_specs = (q_spec, kv_spec, kv_spec) + (row_spec,) * len(rows)
    sharded = jax.shard_map(attend, mesh=problem.mesh, in_specs=in_specs, out_specs=q_spec, check_vma=check_vma)
    return sharded(q, k, v, *rows)


class FusedAttentionKernel:
    """The shared `is_supported`/`__call__` tail of a fused attention kernel (module docstring)."""

    # Registered kernel name; also names the kernel in its call's errors.
    name: str = "fused"
    # Selection priority (an instance may be given another).
    priority: int = 0
    # Call inputs the kernel does not implement: given (not None), the call raises ValueError.
    declined_inputs: tuple[str, ...] = DECLINED_INPUTS
    # jax.shard_map's check_vma for the sharded call.
    check_vma: bool = False

    def check(self, problem: AttentionProblem) -> Support:
        """The kernel's own declines, before the mesh layout and the extras."""
        raise NotImplementedError

    def mesh_layout(self, problem: AttentionProblem) -> tuple[Support, tuple[PartitionSpec, PartitionSpec] | None]:
        """Whether the problem's sharding can run, and the `(q_spec, kv_spec)` to shard_map over (or None)."""
        return attention_mesh_layout(problem)

    def rows(self, problem: AttentionProblem, q, k, *, kv_mask, q_segment_ids, kv_segment_ids) -> dict[str, Any]:
        """The `[batch, length]` inputs `attend` takes, by name: segment ids, then the key mask, those given."""
        given = {"q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "kv_mask": kv_mask}
        return {name: value for name, value in given.items() if value is not None}

    def attend(self, problem: AttentionProblem, q, k, v, **rows):
        """One device's attention, `[b, t, n, h]` like q."""
        raise NotImplementedError

    def is_supported(self, problem: AttentionProblem) -> Support:
        for support in (self.check(problem), self.mesh_layout(problem)[0], unknown_extras(problem)):
            if not support:
                return support
        return SUPPORTED

    def __call__(
        self,
        problem: AttentionProblem,
        q,
        k,
        v,
        *,
        kv_mask=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        q_positions=None,
        kv_positions=None,
        bias=None,
        dropout_key=None,
    ):
        inputs = {"q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "q_positions": q_positions,
                  "kv_positions": kv_positions, "bias": bias, "dropout_key": dropout_key}
        declined = {name: inputs[name] for name in self.declined_inputs}  # Segment ids may be among them.
        specs = checked_call_layout(self.name, problem, self.mesh_layout, q_segment_ids, kv_segment_ids, **declined)
        rows = self.rows(problem, q, k, kv_mask=kv_mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
        names = tuple(rows)

        def attend(q, k, v, *arrays):
            return self.attend(problem, q, k, v, **dict(zip(names, arrays)))

        return run_sharded(problem, specs, attend, q, k, v, *rows.values(), check_vma=self.check_vma)


__all__ = ["DECLINED_INPUTS", "FusedAttentionKernel", "run_sharded"]
