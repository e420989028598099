"""Behaviour shared by every checkpoint backend, run against `orbax` and `tensorstore`."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import axcore
from axcore.checkpoint import (
    CheckpointBackend,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)

BACKENDS = ["orbax", "tensorstore"]


@pytest.fixture(scope="module")
def registries():
    return axcore.create_plugin_manager().registries


@pytest.fixture(params=BACKENDS)
def make(request, registries, tmp_path):
    """`make(subdir="ckpt", **kwargs)` opens the backend under test; all are closed afterwards."""
    factory = registries.checkpoint_backends[request.param]
    opened = []

    def make(subdir="ckpt", **kwargs):
        backend = factory(tmp_path / subdir, **kwargs)
        opened.append(backend)
        return backend

    make.name = request.param
    yield make
    for backend in opened:
        backend.close()


def make_state(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "embed": {"table": jnp.asarray(rng.standard_normal((16, 8), np.float32)), "bias": None},
        "layers": [
            {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.bfloat16), "scale": jnp.float32(rng.standard_normal())},
            {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.bfloat16), "scale": jnp.float32(-0.0)},
        ],
    }
    opt_state = optax.adamw(1e-3).init(params)
    # Non-zero moments, so the optimizer state is not all fill values.
    _, opt_state = optax.adamw(1e-3).update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jnp.int32(seed + 7),
        "prng": jnp.asarray(rng.integers(0, 2**32, (2,), dtype=np.uint32)),
        "tokens": jnp.asarray(rng.integers(-100, 100, (3, 5), dtype=np.int32)),
        "mask": jnp.asarray(rng.random(6) > 0.5),
        "special": jnp.array([np.nan, np.inf, -np.inf, -0.0], jnp.float32),
    }


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_identical(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        where = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where  # Bit-identical (NaN, -0.0).
        assert a.sharding == b.sharding, where


def test_factories_are_registered_by_the_builtin_plugin(registries):
    for name in BACKENDS:
        entry = registries.checkpoint_backends.entry(name)
        assert entry.provenance.plugin == "axcore.checkpoint.plugin"
        assert entry.provenance.distribution == "axcore"


def test_round_trip_is_bit_identical(make):
    state = make_state()
    metadata = {"data": {"epoch": 1, "position": 1234, "files": ["a", "b"]}, "lr": 0.5, "note": None}
    backend = make()
    assert isinstance(backend, CheckpointBackend)
    backend.save(10, state, metadata)
    backend.wait()
    assert backend.latest_step() == 10 and backend.all_steps() == [10]
    restored, meta = backend.restore(abstract(state))
    assert_identical(restored, state)
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    assert meta == metadata


def test_restore_picks_latest_committed_or_the_given_step(make):
    backend = make(keep_last_n=None)
    for step in (1, 2, 3):
        backend.save(step, make_state(step), {"step": step})
    backend.wait()
    assert backend.all_steps() == [1, 2, 3]
    target = abstract(make_state())
    restored, meta = backend.restore(target)
    assert meta == {"step": 3}
    assert_identical(restored, make_state(3))
    restored, meta = backend.restore(target, step=2)
    assert meta == {"step": 2}
    assert_identical(restored, make_state(2))
    # A fresh instance (a restarted run) sees the same steps.
    assert make().all_steps() == [1, 2, 3]


def test_keep_last_n_prunes_older_steps(make):
    backend = make(keep_last_n=2)
    for step in (1, 2, 3, 4):
        backend.save(step, make_state(step), {"step": step})
    backend.wait()
    assert backend.all_steps() == [3, 4]
    assert make().all_steps() == [3, 4]
    with pytest.raises(CheckpointNotFoundError, match=r"step 1 in .*ckpt; committed steps: 3, 4"):
        backend.restore(abstract(make_state()), step=1)


def test_synchronous_save_is_committed_when_save_returns(make):
    backend = make(async_save=False)
    backend.save(jnp.int32(5), make_state(), {})  # Integer scalars of any kind are steps.
    assert backend.latest_step() == 5


def test_saving_an_existing_step_again_keeps_the_first(make, caplog):
    backend = make()
    backend.save(1, make_state(1), {"v": 1})
    backend.wait()
    with caplog.at_level(logging.WARNING):
        backend.save(1, make_state(2), {"v": 2})
    backend.wait()
    assert "already exists" in caplog.text
    restored, meta = backend.restore(abstract(make_state()))
    assert meta == {"v": 1}
    assert_identical(restored, make_state(1))


def test_no_checkpoint(make):
    backend = make("empty")
    assert backend.latest_step() is None and backend.all_steps() == []
    with pytest.raises(CheckpointNotFoundError, match=r"No committed checkpoint in .*empty"):
        backend.restore(abstract(make_state()))


def _mismatch_message(make, edit):
    state = make_state()
    backend = make()
    backend.save(1, state, {})
    backend.wait()
    target = abstract(state)
    edit(target)
    with pytest.raises(CheckpointMismatchError) as info:
        backend.restore(target)
    message = str(info.value)
    assert "step 1 in" in message and "ckpt" in message
    return message


MISSING = "in the target but not in the checkpoint"
EXTRA = "in the checkpoint but not in the target"
DIFFERS = "shape/dtype differs"


def listed(message, label, item):
    """Whether `item` is listed in the `label: a, b, ...;` part of a mismatch message."""
    part = message.split(label + ": ", 1)[1].split("; ")[0]
    return item in part


def test_mismatch_renamed_key(make):
    def rename(target):
        target["params"]["embedding"] = target["params"].pop("embed")

    message = _mismatch_message(make, rename)
    assert listed(message, MISSING, "['params']['embedding']['table']")
    assert listed(message, EXTRA, "['params']['embed']['table']")


def test_mismatch_extra_key(make):
    def add(target):
        target["params"]["layers"][1]["bias"] = jax.ShapeDtypeStruct((8,), jnp.float32)

    message = _mismatch_message(make, add)
    assert listed(message, MISSING, "['params']['layers'][1]['bias']")
    assert EXTRA not in message and DIFFERS not in message


def test_mismatch_shape_and_dtype_list_every_path(make):
    def edit(target):
        target["tokens"] = jax.ShapeDtypeStruct((5, 3), jnp.int32)
        target["step"] = jax.ShapeDtypeStruct((), jnp.float32)
        del target["mask"]

    message = _mismatch_message(make, edit)
    assert listed(message, DIFFERS, "['tokens'] (checkpoint int32[3,5], target int32[5,3])")
    assert listed(message, DIFFERS, "['step'] (checkpoint int32[], target float32[])")
    assert listed(message, EXTRA, "['mask']")


def test_mismatch_in_empty_subtrees(make):
    def edit(target):
        target["opt_state"] = optax.adam(1e-3).init(abstract(make_state()["params"]))  # One EmptyState less.
        target["params"]["embed"]["bias"] = jax.ShapeDtypeStruct((8,), jnp.float32)  # Was None.

    message = _mismatch_message(make, edit)
    assert listed(message, EXTRA, "['opt_state'][2]")
    assert listed(message, DIFFERS, "['params']['embed']['bias'] (checkpoint empty NoneType, target float32[8])")


def test_save_is_safe_against_donation_and_deletion(make):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((1024, 1024), np.float32)  # 4 MB: still being written when save returns.
    state = {"big": jnp.asarray(big), "small": jnp.arange(10, dtype=jnp.int32), "other": jnp.asarray(big[:8])}
    target = abstract(state)
    backend = make()
    backend.save(1, state, {"ok": True})
    state["big"].delete()
    state["small"].delete()
    jax.jit(lambda x: x * 0 + 1, donate_argnums=0)(state["other"]).block_until_ready()  # Reuses the buffer.
    garbage = [jnp.full((1024, 1024), 7.0) for _ in range(3)]  # Fresh allocations over freed memory.
    jax.block_until_ready(garbage)
    backend.wait()
    restored, meta = backend.restore(target)
    assert meta == {"ok": True}
    np.testing.assert_array_equal(np.asarray(restored["big"]), big)
    np.testing.assert_array_equal(np.asarray(restored["small"]), np.arange(10))
    np.testing.assert_array_equal(np.asarray(restored["other"]), big[:8])


def test_bad_inputs_raise_checkpoint_errors(make):
    backend = make()
    with pytest.raises(CheckpointError, match="not JSON-serializable"):
        backend.save(1, make_state(), {"position": np.arange(3)})
    with pytest.raises(CheckpointError, match=r"leaf \['name'\] is a str"):
        backend.save(1, {"name": "x"}, {})
    with pytest.raises(CheckpointError, match="key_data"):
        backend.save(1, {"key": jax.random.key(0)}, {})
    with pytest.raises(CheckpointError, match="non-negative integer"):
        backend.save(-1, make_state(), {})
    with pytest.raises(CheckpointError, match="keep_last_n"):
        make("other", keep_last_n=0)
    assert backend.all_steps() == []


def test_step_of_parses_the_names_the_backend_writes(make):
    """`step_of` (run loading's parse of a step directory) inverts the names each backend puts on disk."""
    backend = make(keep_last_n=None)
    for step in (0, 7, 123456789):
        backend.save(step, {"params": make_state()["params"]}, {"step": step})
    backend.wait()
    names = sorted(n for n in os.listdir(backend.directory) if os.path.isdir(os.path.join(backend.directory, n)))
    # The names are the backend's own: digits (orbax) or step_ and at least 8 digits (tensorstore).
    expected = {"orbax": ["0", "123456789", "7"], "tensorstore": ["step_00000000", "step_00000007", "step_123456789"]}
    assert [n for n in names if n in expected[make.name]] == expected[make.name]
    assert sorted(backend.step_of(n) for n in expected[make.name]) == [0, 7, 123456789] == backend.all_steps()
    for junk in ("", "latest", "7x", "step_7", "step_", "-1", "checkpoints", "7.tmp"):
        assert backend.step_of(junk) is None, junk
