"""Saves sharded arrays over 8 CPU devices and restores them into other shardings.

Run by test_checkpoint_resharding.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Usage: `python
checkpoint_reshard_worker.py DIRECTORY BACKEND...`; prints `RESULT <backend> OK` or
`RESULT <backend> FAIL <error>` per backend.
"""

import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from axcore.checkpoint.plugin import BACKENDS


def values():
    return {
        "w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8),
        "bf": (np.arange(8 * 12).reshape(8, 12) / 3).astype(jnp.bfloat16),
        "partly_replicated": np.arange(8 * 4, dtype=np.int32).reshape(8, 4),
        "grid": np.arange(4 * 8, dtype=np.uint32).reshape(4, 8),
        "scalar": np.float32(3.5),
    }


def check(name, directory):
    devices = np.array(jax.devices())
    assert devices.size == 8, devices
    line = Mesh(devices, ("data",))
    grid = Mesh(devices.reshape(2, 4), ("data", "model"))
    saved_with = {
        "w": NamedSharding(line, P("data")),
        "bf": NamedSharding(line, P("data")),
        "partly_replicated": NamedSharding(grid, P("data")),  # Replica ids 0..3 along 'model'.
        "grid": NamedSharding(grid, P("data", "model")),
        "scalar": NamedSharding(line, P()),
    }
    want = values()
    state = {k: jax.device_put(v, saved_with[k]) for k, v in want.items()}
    backend = BACKENDS[name](os.path.join(directory, name))
    backend.save(1, state, {"ok": 1})
    backend.wait()
    if name == "tensorstore":  # One chunk per saved shard.
        zarr = os.path.join(directory, name, "step_00000001", "arrays", "w", "zarr.json")
        with open(zarr) as f:
            assert json.load(f)["chunk_grid"]["configuration"]["chunk_shape"] == [2, 8]
    for shardings in (
        {k: NamedSharding(grid, P(None, "model")) for k in ("w", "bf", "partly_replicated", "grid")}
        | {"scalar": NamedSharding(grid, P())},
        {k: NamedSharding(grid, P()) for k in want},  # Fully replicated.
        {k: NamedSharding(line, P("data")) for k in ("w", "bf", "partly_replicated")}
        | {"grid": NamedSharding(grid, P("model", "data")), "scalar": SingleDeviceSharding(devices[5])},
    ):
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in want.items()}
        restored, meta = backend.restore(target)
        assert meta == {"ok": 1}, meta
        for k, v in want.items():
            got = restored[k]
            assert got.sharding == shardings[k], (k, got.sharding, shardings[k])
            assert got.dtype == v.dtype and np.asarray(got).tobytes() == np.asarray(v).tobytes(), k
            for shard in got.addressable_shards:
                assert np.asarray(shard.data).tobytes() == np.asarray(v)[shard.index].tobytes(), (k, shard.device)
    backend.close()


def main():
    directory, names = sys.argv[1], sys.argv[2:]
    for name in names:
        try:
            check(name, directory)
            print(f"RESULT {name} OK", flush=True)
        except Exception:
            print(f"RESULT {name} FAIL {traceback.format_exc()!r}", flush=True)


if __name__ == "__main__":
    main()
