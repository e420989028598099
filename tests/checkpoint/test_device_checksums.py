"""`mix32`, the checksum computed on the device: the formula, its NumPy twin, and the orbax item.

The reference is the formula written out in plain Python, word by word (see
`axcore.checkpoint.verify`'s docstring); NumPy's `mix32` (used on restore) and the
jitted device program (used on save) must both equal it.
"""

import json
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from axcore.checkpoint import CheckpointError, verify
from axcore.checkpoint.base import restore_verified
from axcore.checkpoint.plugin import BACKENDS

M = 2**32 - 1


def reference_mix32(a: np.ndarray) -> int:
    """sum_i fmix32(w[i] ^ (i * 0x9E3779B9)) mod 2**32 over little-endian unsigned words."""
    raw = np.ascontiguousarray(a).tobytes()
    size = a.dtype.itemsize
    if size == 8:
        words = struct.unpack(f"<{len(raw) // 4}I", raw)
    else:
        words = [int.from_bytes(raw[i : i + size], "little") for i in range(0, len(raw), size)]
    total = 0
    for i, w in enumerate(words):
        h = w ^ ((i * 0x9E3779B9) & M)
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M
        h ^= h >> 16
        total += h
    return total & M


def arrays(rng):
    return {
        "f32": rng.standard_normal((5, 7)).astype(np.float32),
        "bf16": rng.standard_normal((3, 11)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal(9).astype(np.float16),
        "f8": rng.standard_normal(13).astype(ml_dtypes.float8_e4m3fn),
        "i8": rng.integers(-128, 128, 17, dtype=np.int8),
        "u16": rng.integers(0, 2**16, 6, dtype=np.uint16),
        "i32": rng.integers(-(2**31), 2**31, (2, 3, 4), dtype=np.int32),
        "bool": rng.random(10) > 0.5,
        "scalar": np.float32(-0.0),
        "empty": np.zeros((0, 3), np.float32),
        "special": np.array([np.nan, np.inf, -np.inf, -0.0], np.float32),
    }


def test_numpy_mix32_is_the_formula():
    rng = np.random.default_rng(0)
    for name, a in arrays(rng).items():
        assert verify.mix32(a) == reference_mix32(np.asarray(a)), name
    # Longer than one NumPy block, so the block offsets count.
    long = rng.integers(0, 2**32, 2 * verify.MIX32_BLOCK + 3, dtype=np.uint32)
    assert verify.mix32(long) == reference_mix32(long)


def test_device_mix32_equals_numpy():
    rng = np.random.default_rng(1)
    state = {name: jnp.asarray(a) for name, a in arrays(rng).items()}
    state["big"] = jnp.asarray(rng.standard_normal((300, 700), np.float32))  # > one block
    pieces = verify.start_checksums(state).result()
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        (p,) = pieces[jax.tree_util.keystr(path)]
        assert p == {"index": [[0, d] for d in x.shape], "mix32": verify.mix32(np.asarray(x))}, path


def test_device_mix32_of_64_bit_values():
    with jax.enable_x64(True):
        state = {"i64": jnp.arange(-5, 100, dtype=jnp.int64) * 987654321987, "f64": jnp.linspace(-3, 3, 77)}
        pieces = verify.start_checksums(state).result()
        for k, x in state.items():
            assert pieces[f"['{k}']"][0]["mix32"] == reference_mix32(np.asarray(x)), k


def test_host_leaves_and_sub_byte_dtypes_get_crc32():
    state = {"np": np.arange(6, dtype=np.int64), "i4": jnp.arange(-8, 8, dtype=jnp.int4), "py": 3}
    pieces = verify.start_checksums(state).result()
    assert pieces["['np']"] == [{"index": [[0, 6]], "crc32": zlib.crc32(np.arange(6, dtype=np.int64).tobytes())}]
    assert pieces["['i4']"] == [{"index": [[0, 16]], "crc32": zlib.crc32(np.asarray(state["i4"]).tobytes())}]
    assert list(pieces["['py']"][0]) == ["index", "crc32"]
    assert not verify.device_checksummable(jnp.int4) and verify.device_checksummable(jnp.bfloat16)


def test_any_changed_word_changes_mix32():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(4096).astype(np.float32)
    base = verify.mix32(a)
    words = a.view(np.uint32)
    for i in rng.integers(0, a.size, 50):
        for bit in (0, 17, 31):
            changed = words.copy()
            changed[i] ^= np.uint32(1 << bit)
            assert verify.mix32(changed.view(np.float32)) != base, (i, bit)
    swapped = a.copy()
    swapped[[3, 900]] = swapped[[900, 3]]
    assert verify.mix32(swapped) != base  # Position counts.
    two_signs = a.copy()
    two_signs[[5, 6]] *= -1  # Two sign bits: cancel in a plain sum of words, not here.
    assert verify.mix32(two_signs) != base


@pytest.mark.parametrize("name", ["orbax", "tensorstore"])
def test_a_donating_step_right_after_save_cannot_change_what_was_checksummed(tmp_path, name):
    """As the trainer does: save, then at once a step that donates (and overwrites) the state."""
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    rng = np.random.default_rng(3)
    values = {f"w{i}": rng.standard_normal((512, 1024), np.float32) for i in range(4)}  # 8 MB
    state = step({k: jnp.asarray(v) for k, v in values.items()})
    saved = jax.device_get(state)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with BACKENDS[name](tmp_path) as backend:
        backend.save(1, state, {})
        for _ in range(3):
            state = step(state)
        jax.block_until_ready(state)
        backend.wait()
        restored, _ = backend.restore(target)  # Verifies every checksum.
    for k in values:
        assert np.asarray(restored[k]).tobytes() == saved[k].tobytes(), k


def _orbax_state():
    rng = np.random.default_rng(4)
    return {"w": jnp.asarray(rng.standard_normal((64, 64), np.float32)), "n": jnp.int32(3)}


def _target(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _flip_data(step_dir):
    path = max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"), key=os.path.getsize)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_orbax_steps_with_crc32_in_meta_still_verify(tmp_path):
    """A step as the orbax backend wrote it before the checksums item: CRC32s of process 0's shards in meta."""
    state = _orbax_state()
    with BACKENDS["orbax"](tmp_path) as backend:
        backend.save(1, state, {"v": 1})
    meta_file = tmp_path / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["checksums_item"]
    meta["format"] = "axcore.orbax/1"
    meta["checksums"] = {
        f"['{k}']": [{"index": [[0, d] for d in x.shape], "crc32": zlib.crc32(np.asarray(x).tobytes())}]
        for k, x in state.items()
    }
    meta_file.write_text(json.dumps(meta))
    (tmp_path / "1" / "checksums" / "process_0.json").unlink()  # Not read for such a step.
    with BACKENDS["orbax"](tmp_path) as backend:
        restored, metadata = backend.restore(_target(state))
        assert metadata == {"v": 1} and np.array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
        _flip_data(tmp_path / "1")
        with pytest.raises(CheckpointError, match=r"\['w'\] .* does not match its checksum"):
            backend.restore(_target(state))


def test_orbax_step_missing_a_checksums_file_fails_verification(tmp_path):
    state = _orbax_state()
    with BACKENDS["orbax"](tmp_path) as backend:
        backend.save(1, state, {})
        backend.save(2, state, {})
    (tmp_path / "2" / "checksums" / "process_0.json").unlink()
    with BACKENDS["orbax"](tmp_path) as backend:
        with pytest.raises(CheckpointError) as info:
            backend.restore(_target(state), 2)
        assert str(info.value).startswith("Checkpoint step 2 in ") and "2/checksums/process_0.json is unreadable" in str(info.value)
        assert "\n" not in str(info.value) and info.value.__cause__ is None
        lines = []
        _, _, step = restore_verified(backend, _target(state), report=lines.append)
        assert step == 1 and "checksums/process_0.json is unreadable" in lines[0]


def test_orbax_piece_of_an_unknown_algorithm_is_not_trusted(tmp_path):
    state = _orbax_state()
    with BACKENDS["orbax"](tmp_path) as backend:
        backend.save(1, state, {})
    path = tmp_path / "1" / "checksums" / "process_0.json"
    record = json.loads(path.read_text())
    record["pieces"]["['w']"] = [{"index": [[0, 64], [0, 64]], "sha9": 1}]
    path.write_text(json.dumps(record))
    with BACKENDS["orbax"](tmp_path) as backend, pytest.raises(CheckpointError, match="does not match its checksum"):
        backend.restore(_target(state))


def test_orbax_steps_say_their_format_and_a_newer_one_is_refused_in_one_line(tmp_path):
    """New steps are format /2 (checksums in their own item), which an axcore knowing only /1 refuses."""
    state = _orbax_state()
    with BACKENDS["orbax"](tmp_path) as backend:
        backend.save(1, state, {})
        backend.save(2, state, {})
    assert json.loads((tmp_path / "1" / "meta" / "metadata").read_text())["format"] == "axcore.orbax/2"
    meta_file = tmp_path / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["format"] = "axcore.orbax/3"
    meta_file.write_text(json.dumps(meta))
    with BACKENDS["orbax"](tmp_path) as backend:
        with pytest.raises(CheckpointError) as info:
            backend.restore(_target(state), 2)
        assert "newer axcore" in str(info.value) and "axcore.orbax/3" in str(info.value) and "\n" not in str(info.value)
        lines = []
        _, _, step = restore_verified(backend, _target(state), report=lines.append)
        assert step == 1 and "axcore.orbax/3" in lines[0]
