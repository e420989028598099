"""One of 2 processes (4 CPU devices each): a damaged step is set aside, then saved afresh.

Run by test_set_aside_multiprocess.py: `python checkpoint_set_aside_worker.py PROCESS_ID
PORT DIRECTORY BACKEND...`. Per backend: both processes save steps 5 and 10 of arrays
sharded over the 8 devices; process 0 damages every data file of step 10; both call
`restore_verified(..., set_aside=True)` with fully replicated targets (so each reads,
and verifies, every shard), then save step 10 again. Prints `RESULT <backend> OK
<moved name>` or `RESULT <backend> FAIL <error>`.
"""

import os
import pathlib

import jax
import numpy as np

from two_process_job import worker_main


def damage(directory: pathlib.Path, name: str) -> int:
    """Flips one byte in the middle of every array data file of step 10; returns how many."""
    step_dir = directory / ("10" if name == "orbax" else "step_00000010")
    if name == "orbax":
        files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    else:
        files = [p for p in (step_dir / "arrays").rglob("*") if p.is_file() and "c" in p.relative_to(step_dir).parts]
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
    return len(files)


def check(name: str, root: str) -> str:
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from axcore.checkpoint.base import restore_verified
    from axcore.checkpoint.plugin import BACKENDS

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def values(seed):
        return {"w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * seed, "v": np.arange(8, dtype=np.int32) + seed}

    def state(seed):
        return {k: jax.make_array_from_callback(v.shape, sharded, lambda i, v=v: v[i]) for k, v in values(seed).items()}

    directory = pathlib.Path(root) / name
    backend = BACKENDS[name](directory, keep_last_n=3)
    for step in (5, 10):
        backend.save(step, state(step), {"step": step})
    backend.wait()
    multihost_utils.sync_global_devices(f"saved_{name}")
    if jax.process_index() == 0:
        assert damage(directory, name) > 0
    multihost_utils.sync_global_devices(f"damaged_{name}")
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in values(0).items()}
    lines = []
    restored, meta, step = restore_verified(backend, target, report=lines.append, set_aside=True)
    assert step == 5 and meta == {"step": 5}, (step, meta, lines)
    for k, v in values(5).items():
        assert np.array_equal(np.asarray(restored[k].addressable_shards[0].data), v), k
    assert len(lines) == 1 and "moved it aside to " in lines[0], lines
    moved = lines[0].split("moved it aside to ", 1)[1].split(";")[0]
    assert os.path.isdir(directory.parent / moved), moved
    assert backend.all_steps() == [5], backend.all_steps()
    backend.save(10, state(110), {"step": 10, "fresh": True})
    backend.wait()
    assert backend.all_steps() == [5, 10], backend.all_steps()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharded) for k, v in values(0).items()}
    restored, meta = backend.restore(target, 10)
    assert meta == {"step": 10, "fresh": True}, meta
    for k, v in values(110).items():
        for shard in restored[k].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), v[shard.index]), (k, shard.device)
    backend.close()
    return moved


if __name__ == "__main__":
    worker_main(check)
