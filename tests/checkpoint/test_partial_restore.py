"""Partial restore (`restore(target, step, partial=True)`), per backend: `{"params"}` of a saved train state.

The saved state has the trainer's shape, `{"params", "opt_state", "step", "prng_key"}`, with
arrays big enough (16 KiB) that orbax writes them into separate OCDBT data files. "Not
read" is shown by its observable effect: an optimizer-state data file is corrupted, the
full restore fails on that file's checksum, and the partial restore of the parameters
still returns the saved values.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.checkpoint import CheckpointError, CheckpointMismatchError
from axcore.checkpoint.base import restore_verified
from axcore.checkpoint.plugin import BACKENDS

NAMES = ["orbax", "tensorstore"]


def make_state(seed):
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.standard_normal((64, 64), np.float32)),
        "b": jnp.asarray(rng.standard_normal(500), jnp.bfloat16),
    }
    moments = lambda: jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)  # noqa: E731
    return {
        "params": params,
        "opt_state": ({"mu": moments(), "nu": moments()}, None),
        "step": jnp.int32(seed),
        "prng_key": jnp.asarray(rng.integers(0, 2**32, (2,), dtype=np.uint32)),
    }


def target_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def assert_bits_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path)


@pytest.fixture(params=NAMES)
def saved(request, tmp_path):
    """(name, directory): steps 1 and 2 saved and committed, the backend closed."""
    name, directory = request.param, tmp_path / "ckpt"
    with BACKENDS[name](directory, keep_last_n=None, async_save=False) as backend:
        for step in (1, 2):
            backend.save(step, make_state(step), {"input": {"position": step}, "step": step})
    return name, directory


def params_target(step):
    return {"params": target_of(make_state(step)["params"])}


def step_dir(name, directory, step):
    return directory / (str(step) if name == "orbax" else f"step_{step:08d}")


def data_files(name, directory, step):
    d = step_dir(name, directory, step)
    if name == "tensorstore":
        return sorted(p for p in (d / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")
    return sorted(p for p in (d / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def corrupt(path, offset=None):
    """Flips 16 bytes of `path` from `offset` (default: the middle)."""
    raw = bytearray(path.read_bytes())
    offset = len(raw) // 2 if offset is None else offset
    for i in range(offset, min(len(raw), offset + 16)):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_partial_restore_returns_the_saved_params_only(saved):
    name, directory = saved
    with BACKENDS[name](directory) as backend:
        got, metadata = backend.restore(params_target(2), partial=True)
        assert_bits_equal(got, {"params": make_state(2)["params"]})
        assert metadata == {"input": {"position": 2}, "step": 2}
        older, _ = backend.restore(params_target(1), step=1, partial=True)
        assert_bits_equal(older, {"params": make_state(1)["params"]})
        target = params_target(2)
        for (path, a), t in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(target)):
            assert a.sharding == t.sharding, jax.tree_util.keystr(path)
        # Without `partial` a subtree is a mismatch, as before.
        with pytest.raises(CheckpointMismatchError, match=r"in the checkpoint but not in the target: .*\['opt_state'\]"):
            backend.restore(params_target(2))


def test_optimizer_state_is_not_read(saved):
    """Corrupting an optimizer moment's bytes breaks the full restore, not the partial one.

    orbax packs several arrays into one OCDBT data file, so each file is damaged at
    eight offsets in turn; the cases whose full restore fails on a moment's checksum
    must still restore the parameters.
    """
    name, directory = saved
    named = set()
    for backend, error in _each_damage(name, directory):
        full = re.search(r"(\['opt_state'\]\S*) \[[0-9:,]+\] in .* does not match its checksum", error)
        if full:  # Else the damage hit the parameters or a file's structure (or, orbax, bytes no longer referred to).
            named.add(full.group(1))
            got, _ = backend.restore(params_target(2), step=2, partial=True)
            assert_bits_equal(got, {"params": make_state(2)["params"]})
    assert {"['opt_state'][0]['mu']['w']", "['opt_state'][0]['nu']['w']"} <= named, named


def _each_damage(name, directory):
    """Damages each eighth of each data file of step 2 in turn; yields `(backend, the full restore's error or "")`.

    The file is mended before the next damage; a caller that stops early leaves the last damage in place.
    """
    for path in data_files(name, directory, 2):
        original = path.read_bytes()
        for eighth in range(8):
            corrupt(path, len(original) * eighth // 8)
            with BACKENDS[name](directory) as backend:
                try:
                    backend.restore(target_of(make_state(2)), step=2)
                    error = ""
                except CheckpointError as e:
                    error = str(e)
                yield backend, error
            path.write_bytes(original)


def _damage_params_w(name, directory):
    """Corrupts step 2's bytes of ['params']['w'] (found as for the moments above); -> the full restore's error."""
    for _, error in _each_damage(name, directory):
        if re.search(r"\['params'\]\['w'\] \[0:64,0:64\] in .* does not match its checksum", error):
            return error
    raise AssertionError("no data file holds the bytes of ['params']['w']")


def test_partial_restore_still_verifies_what_it_reads(saved):
    name, directory = saved
    full_error = _damage_params_w(name, directory)
    with BACKENDS[name](directory) as backend:
        with pytest.raises(CheckpointError) as partial:
            backend.restore(params_target(2), partial=True)
        assert str(partial.value) == full_error
        lines = []
        got, _, step = restore_verified(backend, params_target(1), report=lines.append, partial=True)
    assert step == 1 and len(lines) == 1 and "step 2" in lines[0] and "restoring step 1" in lines[0]
    assert_bits_equal(got, {"params": make_state(1)["params"]})


def test_partial_target_must_match_each_entry_it_names(saved):
    name, directory = saved
    params = make_state(2)["params"]
    with BACKENDS[name](directory) as backend:
        with pytest.raises(CheckpointMismatchError) as missing:
            backend.restore({"params": target_of({"w": params["w"]})}, partial=True)
        assert "in the checkpoint but not in the target: ['params']['b']" in str(missing.value)
        with pytest.raises(CheckpointMismatchError) as wrong:
            bad = {"params": {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32), "b": target_of(params["b"]),
                              "extra": jax.ShapeDtypeStruct((3,), jnp.float32)}}
            backend.restore(bad, partial=True)
        message = str(wrong.value)
        assert "in the target but not in the checkpoint: ['params']['extra']" in message
        assert "['params']['w'] (checkpoint float32[64,64], target float32[64,32])" in message
        assert "opt_state" not in message  # Entries the target leaves out are not compared.
        with pytest.raises(CheckpointMismatchError, match=r"in the target but not in the checkpoint: \['ema'\]"):
            backend.restore({"ema": target_of(params["w"])}, partial=True)


def test_entry_names_sharing_a_prefix_are_different_entries(tmp_path):
    """`['params']` selects `['params'][...]`, not `['params2']` (nor `.mu` `.mu2`)."""
    state = {"params": {"w": jnp.ones(3)}, "params2": {"w": jnp.zeros(4)}}
    for name in NAMES:
        with BACKENDS[name](tmp_path / name, async_save=False) as backend:
            backend.save(0, state, {})
            got, _ = backend.restore({"params": target_of(state["params"])}, partial=True)
            assert_bits_equal(got, {"params": state["params"]})
            got, _ = backend.restore({"params2": target_of(state["params2"])}, partial=True)
            assert_bits_equal(got, {"params2": state["params2"]})


class _OldBackend:
    """A backend written before `partial` existed: `restore(target, step=None)`."""

    def __init__(self, inner):
        self.inner = inner

    def all_steps(self):
        return self.inner.all_steps()

    def latest_step(self):
        return self.inner.latest_step()

    def restore(self, target, step=None):
        return self.inner.restore(target, step)


def test_restore_verified_passes_partial_only_when_asked(saved):
    name, directory = saved
    with BACKENDS[name](directory) as backend:
        old = _OldBackend(backend)
        state, _, step = restore_verified(old, target_of(make_state(2)))
        assert step == 2
        assert_bits_equal(state, make_state(2))
        with pytest.raises(TypeError, match="partial"):
            restore_verified(old, params_target(2), 2, partial=True)
