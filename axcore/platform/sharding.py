"""Logical axis names -> mesh axes -> `NamedSharding`s for parameters, batches and activations.

Model code names the dimensions of parameters (`ParameterSpec.mesh_axes`) and of key
activations (`BaseLayer._constrain`) with *logical* axes; the axis rules map each
logical axis to mesh axes. The rules in use are `DEFAULT_AXIS_RULES` overridden per
logical axis by the mesh rule's `axis_rules` (`mesh.axis_rules`; `resolve_rules`):

    logical axis   meaning                                   default mesh axes
    batch          examples of a batch (activations, input)  (data, fsdp)
    seq            sequence positions (activations)          (context, sequence)
    embed          model dimension                           fsdp
    heads          query heads                               tensor
    kv_heads       key/value heads                           tensor
    mlp            feed-forward hidden dimension             tensor
    vocab          vocabulary                                tensor
    expert         experts of a mixture-of-experts layer     expert
    layers         stacked (scanned) layers                  stage (pipeline stages)
    norm           norm scales and biases                    None (replicated)

A logical axis that no rule names, or None, is replicated. Mesh axes absent from the
mesh are dropped, so the one table serves every mesh (a `[data]` mesh shards only
the batch). A rule value is a mesh axis name, a list of them (the dimension is split
over their product, major to minor), or None.

The two sequence axes differ in who computes attention: `sequence` leaves it to GSPMD
(XLA partitions the reference attention as it sees fit), while `context` is context
parallelism: the `context_ring` / `context_all_gather` attention kernels run over it
and the causal LM reorders its batch for load balancing (docs/context_parallelism.md).

Parameters are strict (`logical_to_spec`): a dimension whose size does not divide
the product of its mesh axes, or a mesh axis named by two dimensions of one spec,
is a ConfigError naming the parameter. Activations are lenient (`activation_spec`):
they take whatever the model computes (a batch of 1 when sampling), so a mesh axis
that does not divide the dimension, or that an earlier dimension of the same array
already uses (e.g. `fsdp` of the batch vs. `fsdp` of embed), is left out of that
dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axcore.errors import ConfigError
from axcore.params import ParameterSpec

AxisRules = Mapping[str, "str | Sequence[str] | None"]

# Logical axis -> mesh axis (or axes, major to minor; None = replicated) when the mesh rule does not map it.
DEFAULT_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": ("context", "sequence"),
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "expert": "expert",
    "layers": "stage",
    "norm": None,
}


def resolve_rules(rules: AxisRules | None) -> dict[str, tuple[str, ...] | None]:
    """`DEFAULT_AXIS_RULES` overridden by `rules` (a mesh rule's `axis_rules`), values as tuples or None.

    Idempotent: resolved rules resolve to themselves.
    """
    merged = {**DEFAULT_AXIS_RULES, **dict(rules or {})}
    out: dict[str, tuple[str, ...] | None] = {}
    for logical, target in merged.items():
        if target is None:
            out[logical] = None
        elif isinstance(target, str):
            out[logical] = (target,)
        else:
            out[logical] = tuple(target)
    return out


def mesh_axes_of(logical: str | None, rules: AxisRules | None, mesh: Any) -> tuple[str, ...]:
    """The mesh axes of `mesh` that logical axis `logical` maps to under `rules` (plus defaults)."""
    if logical is None:
        return ()
    target = resolve_rules(rules).get(logical) or ()
    return tuple(name for name in target if name in mesh.axis_names)


def _entry(names: Sequence[str]) -> str | tuple[str, ...] | None:
    names = tuple(names)
    return None if not names else names[0] if len(names) == 1 else names


def _sizes(mesh: Any, names: Sequence[str]) -> str:
    return " x ".join(f"{n}={mesh.shape[n]}" for n in names)


def logical_to_spec(
    mesh_axes: Sequence[str | None] | None,
    shape: Sequence[int],
    rules: AxisRules | None,
    mesh: Any,
    *,
    name: str = "parameter",
) -> PartitionSpec:
    """PartitionSpec of a parameter `name` of `shape` whose dims have logical axes `mesh_axes`.

    Args:
        mesh_axes: one logical axis (or None) per dim; None = replicated entirely.
        shape: the parameter's shape.
        rules: logical -> mesh axes; `DEFAULT_AXIS_RULES` fill the logical axes it lacks.
        mesh: a `Mesh` or `AbstractMesh`; mesh axes it lacks are dropped.
        name: the parameter's path, for errors (e.g. `model.decoder.layer0.self_attention.wq`).

    Returns:
        A spec with one entry per dim.

    Raises:
        ConfigError: a dim does not divide the product of its mesh axes, or one mesh axis
            shards two dims.
    """
    if mesh_axes is None:
        return PartitionSpec()
    if len(mesh_axes) != len(shape):
        raise ConfigError(f"{name}: logical axes {tuple(mesh_axes)} do not match shape {tuple(shape)}.")
    out, used = [], {}
    for i, (logical, dim) in enumerate(zip(mesh_axes, shape)):
        names = mesh_axes_of(logical, rules, mesh)
        size = math.prod(mesh.shape[n] for n in names)
        if dim % size:
            raise ConfigError(
                f"{name} dim {i} ('{logical}') of size {dim} is not divisible by mesh axis {_sizes(mesh, names)} "
                f"(shape {tuple(shape)}); change mesh.mesh_shape, or map '{logical}' to other mesh axes (or null) "
                f"in mesh.axis_rules."
            )
        for n in names:
            if n in used:
                raise ConfigError(
                    f"{name}: mesh axis '{n}' shards both dim {used[n][0]} ('{used[n][1]}') and dim {i} "
                    f"('{logical}'); map one of them to other mesh axes (or null) in mesh.axis_rules."
                )
            used[n] = (i, logical)
        out.append(_entry(names))
    return PartitionSpec(*out)


def activation_spec(
    logical_axes: Sequence[str | None] | None, shape: Sequence[int], rules: AxisRules | None, mesh: Any
) -> PartitionSpec:
    """PartitionSpec of an activation with logical axes such as ("batch", "seq", "heads", None).

    Lenient (module docstring): a mesh axis that does not divide what remains of its
    dim, or that an earlier dim uses, is left out of the dim instead of failing.
    """
    if logical_axes is None:
        return PartitionSpec()
    out, used = [], set()
    for logical, dim in zip(logical_axes, shape):
        kept, size = [], 1
        for n in mesh_axes_of(logical, rules, mesh):
            if n in used or dim % (size * mesh.shape[n]):
                continue
            kept.append(n)
            size *= mesh.shape[n]
        used.update(kept)
        out.append(_entry(kept))
    return PartitionSpec(*out)


def path_name(path: Sequence[Any], prefix: str = "") -> str:
    """A tree path as dotted text: dict keys and attributes `.name`, sequence indices `[i]`."""
    text = prefix
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            text += f"[{key.idx}]"
        else:
            part = key.key if isinstance(key, jax.tree_util.DictKey) else getattr(key, "name", key)
            text += f".{part}" if text else str(part)
    return text


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParameterSpec)


def parameter_specs_to_partition(specs: Any, rules: AxisRules | None, mesh: Any, prefix: str = "model") -> Any:
    """Tree of PartitionSpecs matching a `ParameterSpec` tree (errors name `prefix.path`)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    leaves = [logical_to_spec(s.mesh_axes, s.shape, rules, mesh, name=path_name(p, prefix)) for p, s in flat]
    return jax.tree.unflatten(treedef, leaves)


def parameter_shardings(specs: Any, rules: AxisRules | None, mesh: Any, prefix: str = "model") -> Any:
    """Tree of `NamedSharding` matching a `ParameterSpec` tree (see `logical_to_spec` for errors)."""
    partition = parameter_specs_to_partition(specs, rules, mesh, prefix)
    return jax.tree.map(lambda p: NamedSharding(mesh, p), partition, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_axes(rules: AxisRules | None, mesh: Any) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over: those of logical axis "batch" in `mesh`."""
    return mesh_axes_of("batch", rules, mesh)


def batch_sharding(mesh: Any, rules: AxisRules | None = None) -> NamedSharding:
    """Sharding of `[batch, ...]` inputs: the batch dim over `batch_axes`, other dims replicated."""
    return NamedSharding(mesh, PartitionSpec(_entry(batch_axes(rules, mesh))))


def check_batch_size(batch_size: int, mesh: Any, rules: AxisRules | None, what: str = "input.batch_size") -> None:
    """Raises ConfigError if `batch_size` does not divide over the batch's mesh axes."""
    names = batch_axes(rules, mesh)
    size = math.prod(mesh.shape[n] for n in names)
    if batch_size % size:
        raise ConfigError(
            f"{what} ({batch_size}) is not divisible by the batch's mesh axes {_sizes(mesh, names)} = {size}; "
            f"use a multiple of {size}, change mesh.mesh_shape, or map 'batch' to other mesh axes in mesh.axis_rules."
        )


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces one -1 in `shape` so that the product equals `num_devices`."""
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ConfigError(f"Mesh shape {tuple(shape)} may contain at most one -1.")
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if num_devices % known:
            raise ConfigError(f"Mesh shape {tuple(shape)} does not divide {num_devices} devices.")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ConfigError(
            f"Mesh shape {tuple(shape)} needs {math.prod(shape)} devices but {num_devices} are "
            f"available; set mesh.mesh_shape to match."
        )
    return tuple(shape)


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with `-1` resolved."""
    devices = list(devices if devices is not None else jax.devices())
    resolved = resolve_mesh_shape(shape, len(devices))
    return Mesh(np.asarray(devices).reshape(resolved), tuple(axis_names))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Any, rules: AxisRules | None) -> jax.Array:
    """`x` with a sharding constraint from its logical axes (`activation_spec`); x itself if `mesh` is None.

    `logical_axes` name x's trailing dims (right-aligned): leading dims it does not
    cover are left unconstrained, so one call fits `[batch, seq, dim]` and e.g. a
    `[seq, dim]` slice alike (then only the last `x.ndim` names are used).
    """
    if mesh is None:
        return x
    axes = tuple(logical_axes)[-x.ndim :] if x.ndim else ()
    lead = x.ndim - len(axes)
    spec = activation_spec(axes, x.shape[lead:], rules, mesh)
    full = (PartitionSpec.UNCONSTRAINED,) * lead + tuple(spec) + (None,) * (len(axes) - len(spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*full)))
