"""Where a per-device attention kernel may run under a device mesh, and over which specs.

Fused attention kernels (cuDNN, Pallas, splash, ...) compute one device's batch rows and
heads at a time. Under a multi-device mesh whose input specs shard batch and/or heads,
they run inside `jax.shard_map` over those axes; shardings of the sequence or of
head_dim, or k and v sharded differently, are declined with the reason.
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import PartitionSpec

from axcore.kernels.attention import AttentionProblem
from axcore.kernels.registry import SUPPORTED, Support


def _padded(spec: Any) -> tuple[Any, ...]:
    """A `[b, t, n, h]` PartitionSpec as 4 entries (trailing ones None)."""
    entries = tuple(spec)
    return entries + (None,) * (4 - len(entries))


def _names(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (an axis, a tuple of them, or None)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def shard_count(mesh: Any, entry: Any) -> int:
    """Devices a dimension sharded as `entry` is split over."""
    return math.prod(mesh.shape[axis] for axis in _names(entry))


def attention_mesh_layout(problem: AttentionProblem) -> tuple[Support, tuple[PartitionSpec, PartitionSpec] | None]:
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
        for dim, what in ((1, "sequence dim"), (3, "head_dim")):
            if spec[dim] is not None:
                return Support(False, f"{name}'s {what} is sharded over mesh axis {'+'.join(_names(spec[dim]))}"), None
    if q_spec[0] != k_spec[0]:
        return Support(False, f"q's batch is sharded over {q_spec[0]} but k's over {k_spec[0]}"), None
    if q_spec[2] != k_spec[2]:
        # Sharding query heads but not kv heads (or otherwise) breaks the head -> kv-head grouping.
        return Support(False, f"query heads are sharded over {q_spec[2]} but kv heads over {k_spec[2]}"), None
    if q_spec[0] is None and q_spec[2] is None:
        return SUPPORTED, None
    return SUPPORTED, (PartitionSpec(*q_spec), PartitionSpec(*k_spec))


__all__ = ["attention_mesh_layout", "shard_count"]


def checked_call_layout(
    kernel: str, problem: AttentionProblem, layout: Any, q_segment_ids: Any, kv_segment_ids: Any, /, **declined: Any
) -> tuple[PartitionSpec, PartitionSpec] | None:
    """The `(q_spec, kv_spec)` a fused kernel's call runs over (`layout(problem)`, e.g.
    `attention_mesh_layout`), after refusing what its `is_supported` declines.

    `declined` holds the call's inputs the kernel does not implement (positions, bias,
    dropout key, segment ids for a kernel without them, ...): any of them not None is a ValueError, as are segment ids given
    for one side only and a sharding the layout declines. These are caller bugs (the
    registry asked `is_supported` first), hence ValueError rather than an AxcoreError.
    """
    unexpected = sorted(name for name, value in declined.items() if value is not None)
    if unexpected:
        raise ValueError(f"{kernel} attention was given {unexpected}, which is_supported declines.")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{kernel} attention needs q_segment_ids and kv_segment_ids together.")
    support, specs = layout(problem)
    if not support:
        raise ValueError(f"{kernel} attention cannot run this sharding: {support.reason}.")
    return specs
