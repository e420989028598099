"""The orbax backend: layout and interrupted saves."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.checkpoint import CheckpointNotFoundError
from axcore.checkpoint.plugin import orbax


def _state(value):
    return {"w": jnp.full((4, 3), value, jnp.float32), "n": jnp.int32(value)}


def _target():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


def test_layout_is_orbax_items_plus_json_and_a_commit_marker(tmp_path):
    with orbax(tmp_path) as backend:
        backend.save(3, _state(1), {"position": 7})
    assert sorted(os.listdir(tmp_path / "3")) == [
        "_CHECKPOINT_METADATA", "checksums", "commit_success.txt", "meta", "state"
    ]
    meta = json.loads((tmp_path / "3" / "meta" / "metadata").read_text())
    assert meta["metadata"] == {"position": 7}
    assert {e["path"] for e in meta["index"]} == {"['n']", "['w']"}
    assert meta["checksums_item"] == {"name": "checksums", "processes": 1} and "checksums" not in meta
    assert sorted(os.listdir(tmp_path / "3" / "checksums")) == ["commit_success.txt", "process_0.json"]
    pieces = json.loads((tmp_path / "3" / "checksums" / "process_0.json").read_text())["pieces"]
    assert pieces["['w']"] == [{"index": [[0, 4], [0, 3]], "mix32": pieces["['w']"][0]["mix32"]}]
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith((".pkl", ".pickle"))]


def test_half_written_steps_are_ignored(tmp_path):
    with orbax(tmp_path) as backend:
        backend.save(1, _state(1), {"step": 1})
        backend.save(2, _state(2), {"step": 2})
    # An interrupted save at step 2 (its data complete, the marker not yet written), one
    # at step 3 (an empty directory), and one as orbax's temporary directory.
    os.remove(tmp_path / "2" / "commit_success.txt")
    os.makedirs(tmp_path / "3")
    shutil.copytree(tmp_path / "1", tmp_path / "4.orbax-checkpoint-tmp-1234")
    backend = orbax(tmp_path)
    assert backend.all_steps() == [1] and backend.latest_step() == 1
    state, meta = backend.restore(_target())
    assert meta == {"step": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4, 3), 1.0))
    with pytest.raises(CheckpointNotFoundError, match="step 2 .* committed steps: 1"):
        backend.restore(_target(), step=2)
    # Saving an interrupted step again replaces its leftovers.
    backend.save(2, _state(5), {"step": 5})
    backend.wait()
    assert backend.all_steps() == [1, 2]
    state, meta = backend.restore(_target())
    assert meta == {"step": 5} and int(state["n"]) == 5
    backend.close()


def _bytes_under(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_compression_is_opt_in_and_either_kind_restores(tmp_path):
    state = {"zeros": jnp.zeros((512, 512), jnp.float32), "n": jnp.int32(3)}  # 1 MiB that zstd shrinks.
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    for name, compress in (("plain", False), ("zstd", True)):
        with orbax(tmp_path / name, compress=compress) as backend:
            backend.save(1, state, {})
    assert _bytes_under(tmp_path / "plain") > 2**20 > 50 * _bytes_under(tmp_path / "zstd")
    for name in ("plain", "zstd"):
        with orbax(tmp_path / name) as backend:  # The reader's setting does not matter.
            restored, _ = backend.restore(target)
        np.testing.assert_array_equal(np.asarray(restored["zeros"]), np.zeros((512, 512)))
        assert int(restored["n"]) == 3
