"""A step that fails verification is moved aside, so the fresh state of that step gets saved.

Per backend: steps 5 and 10 saved, step 10 damaged; `restore_verified(...,
set_aside=True)` (what the trainer calls) restores step 5, says in one line where step
10 went, and a new save of step 10 then succeeds and restores bit-exact. The moved
directory keeps its files and is never listed, restored or pruned.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.checkpoint import CheckpointError
from axcore.checkpoint.base import restore_verified
from axcore.checkpoint.plugin import BACKENDS

NAMES = ["orbax", "tensorstore"]


def make_state(seed):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((64, 32), np.float32)), "b": jnp.arange(8, dtype=jnp.int32) + seed}


def target_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def step_name(name, step):
    return str(step) if name == "orbax" else f"step_{step:08d}"


def flip_bytes(name, directory, step):
    """Flips 64 bytes in the middle of the file holding ['w'] (orbax: its largest data file)."""
    d = directory / step_name(name, step)
    if name == "tensorstore":
        path = d / "arrays" / "w" / "c" / "0" / "0"
    else:
        path = max((p for p in (d / "state").rglob("*") if p.is_file() and p.parent.name == "d"), key=os.path.getsize)
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle - 32 : middle + 32] = bytes(b ^ 0xFF for b in raw[middle - 32 : middle + 32])
    path.write_bytes(bytes(raw))


def assert_equal(state, want):
    for k in want:
        assert np.asarray(state[k]).tobytes() == np.asarray(want[k]).tobytes(), k


def aside_dirs(name, directory, step):
    return sorted(p for p in os.listdir(directory) if p.startswith(step_name(name, step) + ".corrupt-"))


@pytest.fixture(params=NAMES)
def saved(request, tmp_path):
    """(name, directory): steps 5 and 10 committed, step 10 damaged, the backend closed."""
    name, directory = request.param, tmp_path / "checkpoints"
    with BACKENDS[name](directory, keep_last_n=2) as backend:
        for step in (5, 10):
            backend.save(step, make_state(step), {"step": step})
    flip_bytes(name, directory, 10)
    return name, directory


def test_damaged_step_is_moved_aside_and_saved_afresh(saved):
    name, directory = saved
    backend = BACKENDS[name](directory, keep_last_n=2)  # A restarted run.
    lines = []
    state, metadata, step = restore_verified(backend, target_of(make_state(0)), report=lines.append, set_aside=True)
    assert step == 5 and metadata == {"step": 5}
    assert_equal(state, make_state(5))
    (moved,) = aside_dirs(name, directory, 10)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"Checkpoint step 10 failed verification \(.*does not match its checksum\); "
        rf"moved it aside to checkpoints/{re.escape(moved)}; restoring step 5\.",
        lines[0],
    ), lines
    assert re.fullmatch(re.escape(step_name(name, 10)) + r"\.corrupt-\d{8}T\d{6}Z", moved)
    assert backend.all_steps() == [5] and backend.incomplete_steps() == []
    assert BACKENDS[name](directory).all_steps() == [5]
    marker = "commit_success.txt" if name == "orbax" else "COMMITTED"
    assert os.path.exists(directory / moved / marker)  # Kept as it was, for inspection.

    fresh = make_state(110)
    backend.save(10, fresh, {"step": 10, "fresh": True})
    backend.wait()
    assert backend.all_steps() == [5, 10]
    state, metadata = backend.restore(target_of(fresh), 10)
    assert metadata == {"step": 10, "fresh": True}
    assert_equal(state, fresh)

    # keep_last_n=2 neither counts nor deletes the moved step.
    for step in (15, 20):
        backend.save(step, make_state(step), {"step": step})
    backend.wait()
    assert backend.all_steps() == [15, 20]
    assert aside_dirs(name, directory, 10) == [moved] and os.path.exists(directory / moved / marker)
    backend.close()
    assert BACKENDS[name](directory).all_steps() == [15, 20]


def test_without_set_aside_nothing_moves(saved):
    name, directory = saved
    with BACKENDS[name](directory) as backend:
        lines = []
        _, _, step = restore_verified(backend, target_of(make_state(0)), report=lines.append)
        assert step == 5 and lines[0].endswith("; restoring step 5.") and "moved" not in lines[0]
        assert backend.all_steps() == [5, 10] and aside_dirs(name, directory, 10) == []


def test_nothing_moves_when_no_step_verifies(saved):
    name, directory = saved
    flip_bytes(name, directory, 5)
    with BACKENDS[name](directory) as backend:
        lines = []
        with pytest.raises(CheckpointError, match="verifies"):
            restore_verified(backend, target_of(make_state(0)), report=lines.append, set_aside=True)
        assert backend.all_steps() == [5, 10] and aside_dirs(name, directory, 10) == aside_dirs(name, directory, 5) == []
        assert len(lines) == 1 and lines[0].endswith("; restoring step 5.") and "moved" not in lines[0]


def test_another_models_checkpoint_is_not_moved(tmp_path):
    for name in NAMES:
        directory = tmp_path / name
        with BACKENDS[name](directory) as backend:
            for step in (5, 10):
                backend.save(step, make_state(step), {"step": step})
        other = {"w": jnp.zeros((16, 32), jnp.bfloat16), "b": jnp.zeros(8, jnp.int32)}
        with BACKENDS[name](directory) as backend:
            lines = []
            with pytest.raises(CheckpointError):
                restore_verified(backend, target_of(other), report=lines.append, set_aside=True)
            assert backend.all_steps() == [5, 10] and not [p for p in os.listdir(directory) if ".corrupt-" in p]
            assert "another model" in lines[0] and "moved" not in lines[0]


@pytest.mark.parametrize("name", NAMES)
def test_an_interrupted_step_does_not_block_its_fresh_save(tmp_path, name):
    """What happens today too: an uncommitted step directory is replaced by the next save of that step."""
    directory = tmp_path / "checkpoints"
    with BACKENDS[name](directory) as backend:
        for step in (5, 10):
            backend.save(step, make_state(step), {"step": step})
    os.remove(directory / step_name(name, 10) / ("commit_success.txt" if name == "orbax" else "COMMITTED"))
    with BACKENDS[name](directory) as backend:
        lines = []
        _, _, step = restore_verified(backend, target_of(make_state(0)), report=lines.append, set_aside=True)
        assert step == 5 and backend.incomplete_steps() == [10]
        assert lines == ["Ignoring checkpoint step 10: it has no commit marker (an interrupted save)."]
        fresh = make_state(110)
        backend.save(10, fresh, {"fresh": True})
        backend.wait()
        assert backend.all_steps() == [5, 10] and backend.incomplete_steps() == []
        state, metadata = backend.restore(target_of(fresh))
        assert metadata == {"fresh": True}
        assert_equal(state, fresh)
    assert not [p for p in os.listdir(directory) if ".corrupt-" in p]


def test_a_failed_rename_is_reported_and_leaves_the_step(saved, monkeypatch):
    name, directory = saved

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)
    with BACKENDS[name](directory) as backend:
        lines = []
        _, _, step = restore_verified(backend, target_of(make_state(0)), report=lines.append, set_aside=True)
        assert step == 5
        assert re.fullmatch(
            r"Checkpoint step 10 failed verification \(.*\); could not move it aside \(cannot rename it: "
            r"PermissionError: Permission denied\); restoring step 5\.",
            lines[0],
        ), lines
        assert backend.all_steps() == [5, 10]


def test_trainer_saves_the_step_again_after_setting_it_aside(tmp_path):
    """Train to 10 (checkpoints every 5), damage 10, run again: resumes from 5 and saves 10 anew.

    The run's step 10 is copied before the damage: the retrained step 10 (the final
    state of the second run) must equal it bit for bit, as training is deterministic.
    """
    import io
    import shutil

    from axcore.experiment import load_experiment
    from axcore.testing import TINY_OVERRIDES
    from axcore.trainer.trainer import Trainer

    args = [
        *TINY_OVERRIDES,
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.checkpoint.backend=orbax",
        "trainer.checkpoint.every_n_steps=5",
        "trainer.eval_every=0",
        "trainer.sample.num_tokens=0",
        "trainer.max_steps=10",
    ]

    def run():
        stream = io.StringIO()
        Trainer(load_experiment(None, args), stream=stream).run()
        return stream.getvalue()

    run()
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(checkpoints / "10", tmp_path / "uninterrupted" / "10")
    flip_bytes("orbax", checkpoints, 10)
    out = run()
    (moved,) = aside_dirs("orbax", checkpoints, 10)
    assert re.search(
        rf"^Checkpoint step 10 failed verification \(.*\); moved it aside to checkpoints/{re.escape(moved)}; "
        r"restoring step 5\.$",
        out,
        re.M,
    ), out
    assert f"Resumed from step 5 in {tmp_path / 'run'}" in out
    target = Trainer(load_experiment(None, args)).step.abstract_state()
    with BACKENDS["orbax"](checkpoints) as a, BACKENDS["orbax"](tmp_path / "uninterrupted") as b:
        assert a.all_steps() == [5, 10] and b.all_steps() == [10]
        got, got_meta = a.restore(target, 10)
        want, want_meta = b.restore(target, 10)
        assert got_meta == want_meta
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), jax.tree_util.keystr(path)
