"""One of 2 processes (4 CPU devices each) joined through jax.distributed.

Run by test_checkpoint_multiprocess.py: `python checkpoint_multiprocess_worker.py
PROCESS_ID PORT DIRECTORY BACKEND...`. Each process saves its shards of global arrays
over the 8 devices, then restores them into other shardings; prints `RESULT
<backend> OK` or `RESULT <backend> FAIL <error>` per backend.
"""

import os

import jax
import numpy as np

from two_process_job import worker_main


def check(name, directory):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from axcore.checkpoint.plugin import BACKENDS

    devices = np.array(jax.devices())
    assert devices.size == 8 and len(jax.local_devices()) == 4
    grid = Mesh(devices.reshape(2, 4), ("data", "model"))
    line = Mesh(devices, ("data",))
    want = {
        "w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8),
        "replicated": np.arange(16, dtype=np.int32),
        "partly_replicated": np.arange(32, dtype=np.float32).reshape(8, 4),
    }
    saved_with = {
        "w": NamedSharding(line, P("data")),
        "replicated": NamedSharding(grid, P()),
        "partly_replicated": NamedSharding(grid, P("data")),
    }
    state = {k: jax.make_array_from_callback(v.shape, saved_with[k], lambda i, v=v: v[i]) for k, v in want.items()}
    backend = BACKENDS[name](os.path.join(directory, name), keep_last_n=1)
    for step in (1, 2):
        backend.save(step, state, {"step": step})
    backend.wait()
    assert backend.latest_step() == 2, backend.all_steps()  # Committed, as seen from every process.
    if jax.process_index() == 0:
        assert backend.all_steps() == [2], backend.all_steps()  # Process 0 prunes before wait() returns.
    new = {
        "w": NamedSharding(grid, P(None, "model")),
        "replicated": NamedSharding(line, P("data")),
        "partly_replicated": NamedSharding(grid, P()),
    }
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=new[k]) for k, v in want.items()}
    restored, meta = backend.restore(target)
    assert meta == {"step": 2}, meta
    for k, v in want.items():
        assert restored[k].sharding == new[k], k
        for shard in restored[k].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), v[shard.index]), (k, shard.device)
    backend.close()


if __name__ == "__main__":
    worker_main(check)
