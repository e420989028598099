"""Checkpoint I/O: the orbax and tensorstore backends against raw tensorstore zarr3.

State: a ~100M-parameter train state on the CPU device, shaped like a transformer's
AdamW state: `params` (a d=1024 decoder: 8192x1024 embedding, 2 layers of 4 attention
projections 1024x1024, an FFN 1024x4096 + 4096x1024 and two norm scales, and a final
norm; 33.6M float32) plus `opt_state` {`mu`, `nu`} of the same shapes and a `step`
scalar: 100.7M float32 values, 403 MB, 55 leaves. Values are random (incompressible).

Contenders, alternated within the run (raw, orbax, tensorstore, raw, ...; 7 rounds,
each into a fresh directory under one temp dir on the same disk, deleted after use):

- backends (`registries.checkpoint_backends[name](dir, keep_last_n=None, async_save=True)`):
  *blocking* = time `save()` holds the caller; *save total* = `save()` + `wait()`
  (until the step is committed); *restore* = `restore()` into SingleDeviceSharding
  ShapeDtypeStruct targets, blocked until the arrays are ready.
- raw: minimal tensorstore code with one shared `ts.Context`: one zarr3 array per
  leaf (one chunk per array, no compression) written from zero-copy NumPy views,
  all writes issued concurrently then awaited; read = open and read all
  concurrently, then `jax.device_put(..., may_alias=True)` each onto the device.

Reads follow the writes of the same round, so they come from the OS page cache for
every contender alike. Throughput = state bytes / time; ratios are raw time /
backend time per round (= backend throughput / raw throughput).
Targets: blocking <= 50 ms; save and restore throughput >= 70% of raw.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import adamw_like_state, decoder_param_shapes, pairwise_ratio, summarize, timed, write_result

NAME = "checkpoint_io"
BACKENDS = ("orbax", "tensorstore")
BLOCKING_TARGET_S = 0.050
THROUGHPUT_TARGET = 0.70


def param_shapes(smoke: bool) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the benchmark state (d=1024, 2 layers; d=64 in smoke mode: ~4 MB in all)."""
    return decoder_param_shapes(*((64, 4096, 2) if smoke else (1024, 8192, 2)))


def make_state(smoke: bool, seed: int = 0) -> dict[str, Any]:
    """The train state: params, AdamW-like mu/nu of the same shapes, step (see module docstring)."""
    return adamw_like_state(param_shapes(smoke), seed)


def _abstract(state: Any) -> Any:
    import jax

    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


# -- raw tensorstore ------------------------------------------------------------------------


def _raw_spec(path: str, shape=None, dtype=None) -> dict:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
    if shape is not None:
        spec["metadata"] = {
            "shape": list(shape),
            "data_type": dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, d) for d in shape]}},
        }
    return spec


def raw_write(state: Any, directory: str, context: Any = None) -> None:
    """One zarr3 array per leaf, every write issued before any is awaited."""
    import jax
    import numpy as np
    import tensorstore as ts

    context = context or ts.Context()
    leaves = jax.tree.leaves(state)
    hosts = [np.asarray(x) for x in leaves]  # Zero-copy views of the CPU buffers.
    opens = [
        ts.open(_raw_spec(os.path.join(directory, str(i)), h.shape, h.dtype), create=True, open=True, context=context)
        for i, h in enumerate(hosts)
    ]
    writes = [f.result().write(h) for f, h in zip(opens, hosts)]
    for w in writes:
        w.result()


def raw_read(target: Any, directory: str, context: Any = None) -> Any:
    """Reads every leaf concurrently, then puts each on the target's device (without a copy)."""
    import jax
    import tensorstore as ts

    context = context or ts.Context()
    flat, treedef = jax.tree.flatten(target)
    opens = [
        ts.open(_raw_spec(os.path.join(directory, str(i))), open=True, read=True, context=context)
        for i in range(len(flat))
    ]
    reads = [f.result().read() for f in opens]
    arrays = [jax.device_put(r.result(), sds.sharding, may_alias=True) for r, sds in zip(reads, flat)]
    return jax.block_until_ready(jax.tree.unflatten(treedef, arrays))


# -- the run --------------------------------------------------------------------------------


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, *, rounds: int | None = None) -> dict[str, Any]:
    """Alternates raw / orbax / tensorstore save and restore; writes checkpoint_io.json."""
    import jax
    import numpy as np

    import axcore

    rounds = rounds or (1 if smoke else 7)
    factories = axcore.create_plugin_manager().registries.checkpoint_backends
    state = make_state(smoke)
    target = _abstract(state)
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    n_values = sum(x.size for x in leaves)
    metadata = {"input": {"position": 123}, "step": 1000}

    times: dict[str, list[float]] = {
        k: [] for k in ("raw/write", "raw/read", *(f"{b}/{m}" for b in BACKENDS for m in ("blocking", "save_total", "restore")))
    }
    root = tempfile.mkdtemp(prefix="axcore-ckpt-bench-")
    counter = iter(range(1_000_000))

    def fresh() -> str:
        path = os.path.join(root, f"d{next(counter)}")
        os.makedirs(path)
        return path

    def raw_round(record: bool) -> None:
        directory = fresh()
        write_s = timed(lambda: raw_write(state, directory))
        restored: list[Any] = []
        read_s = timed(lambda: restored.append(raw_read(target, directory)))
        if record:
            times["raw/write"].append(write_s)
            times["raw/read"].append(read_s)
            _check_equal(state, restored[0])
        shutil.rmtree(directory)

    def backend_round(name: str, record: bool) -> None:
        directory = fresh()
        backend = factories[name](directory, keep_last_n=None, async_save=True)
        try:
            t0 = time.perf_counter()
            backend.save(1000, state, metadata)
            t1 = time.perf_counter()
            backend.wait()
            t2 = time.perf_counter()
            restored: list[Any] = []
            restore_s = timed(lambda: restored.append(jax.block_until_ready(backend.restore(target))))
        finally:
            backend.close()
        if record:
            times[f"{name}/blocking"].append(t1 - t0)
            times[f"{name}/save_total"].append(t2 - t0)
            times[f"{name}/restore"].append(restore_s)
            restored_state, restored_meta = restored[0]
            _check_equal(state, restored_state)
            assert restored_meta == metadata, restored_meta
        shutil.rmtree(directory)

    try:
        # Warm-up (not recorded): imports orbax/tensorstore, starts their thread pools.
        raw_round(record=False)
        for name in BACKENDS:
            backend_round(name, record=False)
        for _ in range(rounds):
            raw_round(record=True)
            for name in BACKENDS:
                backend_round(name, record=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mb = nbytes / 1e6
    results: dict[str, Any] = {k: {**summarize(v), "MB_per_s": mb / float(np.median(v))} for k, v in times.items()}
    for name in BACKENDS:
        results[f"{name}/blocking"].pop("MB_per_s")
    ratios = {}
    for name in BACKENDS:
        ratios[f"{name}/save_vs_raw_write"] = pairwise_ratio(times["raw/write"], times[f"{name}/save_total"])
        ratios[f"{name}/restore_vs_raw_read"] = pairwise_ratio(times["raw/read"], times[f"{name}/restore"])
    targets = {}
    for name in BACKENDS:
        blocking = results[f"{name}/blocking"]["median"]
        save = ratios[f"{name}/save_vs_raw_write"]["median"]
        restore = ratios[f"{name}/restore_vs_raw_read"]["median"]
        targets[f"{name}/blocking_s"] = {"target": f"<= {BLOCKING_TARGET_S}", "value": blocking, "met": blocking <= BLOCKING_TARGET_S}
        targets[f"{name}/save_throughput_vs_raw"] = {
            "target": f">= {THROUGHPUT_TARGET}", "value": save, "met": save >= THROUGHPUT_TARGET,
            "metric": "median over rounds of raw write time / (save + wait) time",
        }
        targets[f"{name}/restore_throughput_vs_raw"] = {
            "target": f">= {THROUGHPUT_TARGET}", "value": restore, "met": restore >= THROUGHPUT_TARGET,
            "metric": "median over rounds of raw read time / restore time",
        }
    data = {
        "smoke": smoke,
        "setup": {
            "state": f"AdamW-like train state: params + mu + nu of a d={param_shapes(smoke)['final_norm'][0]} "
            "decoder, float32, plus an int32 step",
            "values": int(n_values),
            "bytes": int(nbytes),
            "leaves": len(leaves),
            "rounds": rounds,
            "order": "warm-up round, then per round: raw, orbax, tensorstore (fresh directory each)",
            "directory": os.path.dirname(root),
            "backend_options": {"keep_last_n": None, "async_save": True},
            "restore_target": "ShapeDtypeStruct leaves with SingleDeviceSharding(cpu:0)",
            "notes": "reads follow writes, so all contenders read from the page cache",
        },
        "results": results,
        "ratios_to_raw": ratios,
        "targets": targets,
        "raw": times,
    }
    write_result(NAME, data, results_dir=results_dir)
    return data


def _check_equal(expected: Any, actual: Any) -> None:
    import jax
    import numpy as np

    a, b = jax.tree.leaves(expected), jax.tree.leaves(actual)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert np.array_equal(np.asarray(x), np.asarray(y))


if __name__ == "__main__":
    import json

    print(json.dumps(run(smoke="--smoke" in sys.argv)["targets"], indent=2))
