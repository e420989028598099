"""The tensorstore backend: on-disk layout, commit marker, failures, helpers."""

import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.checkpoint import CheckpointError, tensorstore_backend as tsb
from axcore.checkpoint.plugin import tensorstore


def _state(value):
    return {
        "params": {"w": jnp.full((4, 3), value, jnp.bfloat16), "b": jnp.arange(3, dtype=jnp.uint8)},
        "step": jnp.int32(value),
    }


def _target():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


def test_layout(tmp_path):
    with tensorstore(tmp_path) as backend:
        backend.save(12, _state(1), {"position": 7})
    step_dir = tmp_path / "step_00000012"
    assert sorted(os.listdir(step_dir)) == ["COMMITTED", "arrays", "index.json"]
    assert sorted(os.listdir(step_dir / "arrays")) == ["params.b", "params.w", "step"]
    zarr = json.loads((step_dir / "arrays" / "params.w" / "zarr.json").read_text())
    assert zarr["zarr_format"] == 3 and zarr["data_type"] == "bfloat16" and zarr["shape"] == [4, 3]
    assert json.loads((step_dir / "arrays" / "step" / "zarr.json").read_text())["shape"] == []
    index = json.loads((step_dir / "index.json").read_text())
    assert index["metadata"] == {"position": 7} and index["step"] == 12
    assert {e["path"]: (e["name"], e["dtype"]) for e in index["arrays"]} == {
        "['params']['b']": ("params.b", "uint8"),
        "['params']['w']": ("params.w", "bfloat16"),
        "['step']": ("step", "int32"),
    }


def test_uncommitted_steps_are_ignored(tmp_path):
    with tensorstore(tmp_path, keep_last_n=None) as backend:
        for step in (1, 2, 3):
            backend.save(step, _state(step), {"step": step})
    os.remove(tmp_path / "step_00000003" / "COMMITTED")  # Complete but not committed.
    os.remove(tmp_path / "step_00000002" / "COMMITTED")  # Arrays but neither index nor marker.
    os.remove(tmp_path / "step_00000002" / "index.json")
    os.makedirs(tmp_path / "step_00000004" / "arrays")  # Interrupted early.
    backend = tensorstore(tmp_path)
    assert backend.all_steps() == [1] and backend.latest_step() == 1
    state, meta = backend.restore(_target())
    assert meta == {"step": 1} and int(state["step"]) == 1
    # Saving an interrupted step again replaces its leftovers.
    backend.save(3, _state(9), {"step": 9})
    backend.wait()
    assert backend.all_steps() == [1, 3]
    state, meta = backend.restore(_target())
    assert meta == {"step": 9} and float(state["params"]["w"][0, 0]) == 9.0
    backend.close()


def test_committed_step_with_broken_index_names_the_fix(tmp_path):
    with tensorstore(tmp_path) as backend:
        backend.save(1, _state(1), {})
    (tmp_path / "step_00000001" / "index.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"step 1 .* index.json is unreadable .* delete .*step_00000001"):
        tensorstore(tmp_path).restore(_target())


def test_write_failure_surfaces_in_wait_and_commits_nothing(tmp_path, monkeypatch):
    def fail(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tsb, "_atomic_write", fail)
    backend = tensorstore(tmp_path)
    backend.save(1, _state(1), {})
    with pytest.raises(CheckpointError, match=r"Saving step 1 in .* failed: OSError.*No space left"):
        backend.wait()
    assert backend.all_steps() == []
    backend.close()


def test_pruning_uncommits_before_deleting(tmp_path):
    with tensorstore(tmp_path, keep_last_n=1) as backend:
        backend.save(1, _state(1), {})
        backend.save(2, _state(2), {})
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]


def test_array_names_are_safe_and_unique():
    tree = {"a/b": 1, "a b": 2, "..": 3, "x": [4, (5,)], "": 6}
    used = set()
    names = [tsb.unique_array_name(p, used) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert names == ["_", "_-2", "a_b", "a_b-2", "x.0", "x.1.0"]
    assert tsb.unique_array_name((), set()) == "root"
    long = tsb.unique_array_name((jax.tree_util.DictKey("k" * 400),), set())
    assert len(long) < 150


def test_chunks_tile_the_shards():
    assert tsb.chunk_shape((16, 8), 4) == (16, 8)
    assert tsb.chunk_shape((0, 3), 4) == (1, 3)
    assert tsb.chunk_shape((), 4) == ()
    big = tsb.chunk_shape((8192, 8192), 4)  # 256 MiB -> at most 64 MiB, dividing the shard.
    assert np.prod(big) * 4 <= 64 << 20 and all(s % c == 0 for s, c in zip((8192, 8192), big))


def test_numpy_and_zero_size_leaves(tmp_path):
    state = {"np": np.arange(6, dtype=np.int64).reshape(2, 3), "empty": jnp.zeros((0, 4)), "f": jnp.float32(2.5)}
    with tensorstore(tmp_path) as backend:
        backend.save(1, state, {})
        backend.wait()
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)  # No sharding: device 0.
        restored, _ = backend.restore(target)
    np.testing.assert_array_equal(np.asarray(restored["np"]), state["np"])
    assert restored["empty"].shape == (0, 4) and float(restored["f"]) == 2.5


def test_donation_during_pending_save_keeps_saved_values_and_frees_after(tmp_path):
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    state = step({"w": jnp.zeros((1024, 1024))})
    with tensorstore(tmp_path) as backend:
        write, stepped = backend._write, threading.Event()
        backend._write = lambda *args: stepped.wait(10) and write(*args)  # Writes only after the step.
        backend.save(1, state, {})
        new = step(state)  # While the write waits, XLA must not reuse (and overwrite) the buffer.
        np.testing.assert_array_equal(np.asarray(new["w"]), np.full((1024, 1024), 2.0))
        stepped.set()
        backend.wait()
        restored, _ = backend.restore(_abstract(new))
        newer = step(new)  # No save pending: nothing holds `new`, so donation reuses it.
        assert new["w"].is_deleted()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((1024, 1024)))
    np.testing.assert_array_equal(np.asarray(newer["w"]), np.full((1024, 1024), 3.0))


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
