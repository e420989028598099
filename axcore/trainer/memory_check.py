"""Refusing a run that cannot fit, before anything is allocated.

Two estimates per device, both against the device's memory (`bytes_limit` from
`Device.memory_stats()` on GPUs and TPUs; on CPU devices, the host's physical
memory shared by the local CPU devices):

1. `check_state_memory`, before compiling: the train state's bytes per device
   (each array's shard shape under its sharding), and the host bytes of one batch.
   It catches a model that could never fit (e.g. `model.dim=1048576`, within the
   config bounds of `axcore.config.Width` but far past any machine's memory) without
   asking XLA to compile it.
2. `check_compiled_memory`, after compiling the train step ahead of time: XLA's
   `memory_analysis()` peak = arguments + outputs + temporaries - aliased (the same
   estimate `axcore compile` reports). `memory_analysis` here is the one place XLA's
   analysis is read (`axcore.trainer.compile_analysis`, the benchmarks).

Set `trainer.check_memory: false` to skip both.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from axcore.data.schema import BATCH_SCHEMA
from axcore.errors import AxcoreError

# The per-device sizes `axcore compile` reports, in this order (`<field>_size_in_bytes` of XLA's analysis).
MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")


def memory_analysis(compiled: Any) -> dict[str, int]:
    """Every byte count of XLA's `compiled.memory_analysis()` (per device), keyed by its attribute name.

    E.g. `argument_size_in_bytes`, `temp_size_in_bytes`, `peak_memory_in_bytes`. Empty if the
    backend gives no analysis (some raise, some return None).
    """
    try:
        stats = compiled.memory_analysis()
    except Exception:  # Not every backend implements it.
        return {}
    if stats is None:
        return {}
    fields = {}
    for name in dir(stats):
        if name.endswith("_in_bytes"):
            value = getattr(stats, name, None)
            if value is not None:
                fields[name] = int(value)
    return fields


def memory_sizes(analysis: dict[str, int]) -> dict[str, int]:
    """`MEMORY_FIELDS` (short names, bytes per device) present in a `memory_analysis` result, in that order."""
    return {f: analysis[f"{f}_size_in_bytes"] for f in MEMORY_FIELDS if f"{f}_size_in_bytes" in analysis}


def estimated_peak(sizes: dict[str, int]) -> int:
    """Peak bytes per device = argument + output + temp - alias, of `memory_sizes`'s short names."""
    return sizes.get("argument", 0) + sizes.get("output", 0) + sizes.get("temp", 0) - sizes.get("alias", 0)


class MemoryEstimateError(AxcoreError):
    """The estimated memory of a run exceeds what its devices (or the host) have."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_memory_bytes() -> int | None:
    """Physical memory of this host, or None if the OS does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device: Any) -> int | None:
    """Memory one device may use: its allocator's `bytes_limit`, else a CPU device's share of the host."""
    try:
        stats = device.memory_stats()
    except Exception:  # Backends without memory stats raise or return None.
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        host = host_memory_bytes()
        local_cpus = sum(1 for d in jax.local_devices() if d.platform == "cpu")
        return host // max(local_cpus, 1) if host else None
    return None


def per_device_bytes(abstract: Any) -> int:
    """Bytes per device of a tree of ShapeDtypeStructs carrying shardings (largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.float64)) * np.dtype(leaf.dtype).itemsize
    return total


def check_state_memory(abstract_state: Any, mesh: jax.sharding.Mesh, batch_tokens: int) -> None:
    """Raises MemoryEstimateError if the train state alone, or one host batch, cannot fit.

    Args:
        abstract_state: the train state as ShapeDtypeStructs with their shardings.
        mesh: the run's mesh (its first device's memory is the limit).
        batch_tokens: batch_size * seq_len (the host holds every BATCH_SCHEMA field of each token).
    """
    state = per_device_bytes(abstract_state)
    limit = device_memory_bytes(mesh.devices.flat[0])
    if limit is not None and state > limit:
        raise MemoryEstimateError(
            f"The train state (parameters and optimizer state) needs {_gib(state)} per device, more than the "
            f"{_gib(limit)} a device has; shrink the model (model.dim, model.num_layers, vocab_size) or shard it "
            f"over more devices (mesh.mesh_shape, mesh.axis_rules)."
        )
    host = host_memory_bytes()
    per_token = sum(np.dtype(f.dtype).itemsize for f in BATCH_SCHEMA.fields)
    batch = per_token * batch_tokens
    if host is not None and batch > host // 2:
        raise MemoryEstimateError(
            f"One batch needs {_gib(batch)} of host memory (input.batch_size x input.seq_len x {per_token} bytes), more "
            f"than half of this host's {_gib(host)}; lower input.batch_size or input.seq_len."
        )


def check_compiled_memory(compiled: Any, mesh: jax.sharding.Mesh) -> int | None:
    """Raises MemoryEstimateError if the compiled step's estimated peak exceeds a device's memory.

    Returns the estimated peak bytes per device (None if the backend gives no memory analysis).
    """
    sizes = memory_sizes(memory_analysis(compiled))
    if not sizes:
        return None
    peak = estimated_peak(sizes)
    limit = device_memory_bytes(mesh.devices.flat[0])
    if limit is not None and peak > limit:
        raise MemoryEstimateError(
            f"The compiled train step needs an estimated {_gib(peak)} per device (arguments + outputs + "
            f"temporaries - aliased), more than the {_gib(limit)} a device has; lower input.batch_size, use "
            f"trainer.microbatches or a remat_policy, or shard over more devices. 'axcore compile' shows the "
            f"estimate; trainer.check_memory=false skips this check."
        )
    return peak
