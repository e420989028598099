"""Conformance checks of a checkpoint backend (`axcore.checkpoint.CheckpointBackend`).

`open_backend(directory, **kwargs)` opens the backend under test (the factory a plugin
registers, called as `factory(directory, *, keep_last_n=..., async_save=...)`). The
checks: a bit-identical round trip of a mixed-dtype state and its metadata (async and
sync saves); commit-marker atomicity (a step whose marker was never written is
invisible: not listed, not restored, not found by step); restore into another
sharding than the one saved; mismatch errors naming the offending paths.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from axcore.checkpoint import CheckpointBackend, CheckpointMismatchError, CheckpointNotFoundError

OpenBackend = Callable[..., Any]


def make_state(seed: int = 0) -> dict:
    """A small state: nested dicts and lists, float32, bfloat16, int32, uint32, bool, scalars, NaN, inf and -0.0."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
            "layers": [jnp.asarray(rng.standard_normal((8, 2)), jnp.bfloat16), jnp.float32(rng.standard_normal())],
        },
        "step": jnp.int32(seed + 7),
        "prng": jnp.asarray(rng.integers(0, 2**32, (2,), dtype=np.uint32)),
        "mask": jnp.asarray(rng.random(8) > 0.5),
        "special": jnp.array([np.nan, np.inf, -np.inf, -0.0], jnp.float32),
    }


def abstract(state, sharding_of: Callable[[Any], Any] | None = None):
    """The restore target of `state`: ShapeDtypeStructs with each leaf's sharding (or `sharding_of(leaf)`)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x) if sharding_of else x.sharding), state
    )


def assert_identical(got, want, shardings=None) -> None:
    """Same tree, shapes, dtypes and bytes (NaN and -0.0 included); placed with `shardings` if given."""
    assert jax.tree.structure(got) == jax.tree.structure(want), "restored tree differs from the saved one"
    targets = jax.tree.leaves(shardings) if shardings is not None else [None] * len(jax.tree.leaves(want))
    for (path, a), b, target in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), targets):
        where = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.shape} {a.dtype}, saved {b.shape} {b.dtype}"
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{where}: restored values differ from the saved ones"
        if target is not None:
            assert a.sharding == target.sharding, f"{where}: restored with {a.sharding}, asked for {target.sharding}"


def check_round_trip(open_backend: OpenBackend, directory: str) -> None:
    """Async save + wait, and a synchronous save: both restore bit-identically with their metadata."""
    backend = open_backend(os.path.join(directory, "async"), async_save=True)
    assert isinstance(backend, CheckpointBackend), f"{backend!r} does not implement the checkpoint backend protocol"
    state = make_state(1)
    backend.save(5, state, {"data_position": 1234, "note": "é", "nested": {"a": [1, 2.5, None]}})
    backend.wait()
    assert backend.all_steps() == [5] and backend.latest_step() == 5, backend.all_steps()
    got, metadata = backend.restore(abstract(state))
    assert_identical(got, state, abstract(state))
    assert metadata == {"data_position": 1234, "note": "é", "nested": {"a": [1, 2.5, None]}}, metadata
    backend.close()
    sync = open_backend(os.path.join(directory, "sync"), async_save=False)
    sync.save(1, make_state(2), {})
    assert sync.latest_step() == 1, "a synchronous save is committed when save() returns"
    assert_identical(sync.restore(abstract(make_state(2)), step=1)[0], make_state(2))
    sync.close()


def check_commit_atomicity(open_backend: OpenBackend, directory: str, uncommit: Callable[[str, int], None]) -> None:
    """A step whose commit marker is missing (a write interrupted before commit) is invisible.

    `uncommit(directory, step)` removes the marker of a committed step (it must find it:
    a backend that writes none fails here).
    """
    backend = open_backend(directory, async_save=False, keep_last_n=None)
    backend.save(1, make_state(1), {"step": 1})
    backend.save(2, make_state(2), {"step": 2})
    backend.wait()
    backend.close()
    uncommit(directory, 2)  # As if the write of step 2 stopped before its commit marker.
    reopened = open_backend(directory, async_save=False, keep_last_n=None)
    assert reopened.all_steps() == [1] and reopened.latest_step() == 1, (
        f"an uncommitted step is listed: all_steps() = {reopened.all_steps()}"
    )
    got, metadata = reopened.restore(abstract(make_state(1)))
    assert_identical(got, make_state(1))
    assert metadata == {"step": 1}, metadata
    try:
        reopened.restore(abstract(make_state(2)), step=2)
    except CheckpointNotFoundError:
        pass
    else:
        raise AssertionError("restore(step=2) read a step without its commit marker")
    # Saving the interrupted step again replaces its leftovers and commits it.
    reopened.save(2, make_state(3), {"step": 3})
    reopened.wait()
    assert reopened.all_steps() == [1, 2], reopened.all_steps()
    assert_identical(reopened.restore(abstract(make_state(3)), step=2)[0], make_state(3))
    reopened.close()


def _shardings():
    """(saved, restored): per-leaf sharding functions that differ (device split vs single device)."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("x",))

    def split(x):  # Rows over every device where they divide, else replicated over the mesh.
        spec = PartitionSpec("x") if x.ndim and x.shape[0] % len(devices) == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    def single(x):
        return SingleDeviceSharding(devices[-1])

    return split, single


def check_restore_into_another_sharding(open_backend: OpenBackend, directory: str) -> None:
    """Saved with one sharding, restored into another (both ways): values equal, placed as asked."""
    split, single = _shardings()
    state = make_state(4)
    for i, (saved_as, restored_as) in enumerate(((single, split), (split, single))):
        placed = jax.tree.map(lambda x, f=saved_as: jax.device_put(x, f(x)), state)
        backend = open_backend(os.path.join(directory, str(i)), async_save=False)
        backend.save(1, placed, {})
        target = abstract(state, restored_as)
        got, _ = backend.restore(target)
        assert_identical(got, state, target)
        backend.close()


def check_mismatch_errors(open_backend: OpenBackend, directory: str) -> None:
    """No checkpoint, a renamed key, and a changed shape and dtype: each a clear error naming what differs."""
    backend = open_backend(directory, async_save=False)
    try:
        backend.restore(abstract(make_state()))
    except CheckpointNotFoundError:
        pass
    else:
        raise AssertionError("restoring from an empty directory did not raise CheckpointNotFoundError")
    state = make_state()
    backend.save(1, state, {})
    renamed = dict(state)
    renamed["renamed_step"] = renamed.pop("step")
    wrong = jax.tree.map(lambda x: x, state)
    wrong["params"]["w"] = jnp.zeros((4, 8), jnp.float32)  # Shape.
    wrong["mask"] = jnp.zeros(8, jnp.int32)  # Dtype.
    for target, names in ((renamed, ["renamed_step"]), (wrong, ["w", "mask"])):
        try:
            backend.restore(abstract(target))
        except CheckpointMismatchError as e:
            missing = [n for n in names if n not in str(e)]
            assert not missing, f"the mismatch error does not name {missing}: {e}"
        else:
            raise AssertionError(f"restoring into a target that differs in {names} did not raise CheckpointMismatchError")
    backend.close()
