"""Checksums of saved arrays and metadata, and their verification on restore.

Each backend records, per array leaf, a checksum of every piece it wrote
(`{"index": [[start, stop], ...], <algorithm>: n}`, one per replica-0 shard; with
several processes each contributes its own shards) and the CRC32 of the metadata's
canonical JSON, all written before the commit marker. On restore every piece
contained in the host data this process read is checksummed again and compared; a
piece that is not (a finer target sharding, or another process's shard) is read
separately where the backend can, else left unverified. A piece whose algorithm is
unknown fails verification.

Two algorithms, named by the record's key:

- `crc32`: zlib's CRC32 of the piece's C-order bytes. The tensorstore backend computes
  it in its background write thread from the host copy it writes; orbax checkpoints
  written before `mix32` existed carry it too, and it stays verifiable.
- `mix32`: computed on the device, so that no extra device-to-host copy of the state is
  needed (`start_checksums`). The piece's bytes are read as unsigned words `w[i]`, one
  per element (1-, 2- and 4-byte elements zero-extended to 32 bits; an 8-byte element
  is two words, low half first), and
  `mix32 = sum_i fmix32(w[i] XOR (i * 0x9E3779B9 mod 2**32)) mod 2**32`, where fmix32 is
  MurmurHash3's 32-bit finalizer. For a fixed position the word-to-term map is a
  bijection, so any change of one word always changes the sum, and the position term
  makes moved or swapped words count; several changed words collide with probability
  about 2**-32, as with CRC32. NumPy computes the same value on restore (`mix32`) at
  about CRC32's speed.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from axcore.checkpoint.base import CheckpointError
from axcore.errors import one_line

Index = tuple[tuple[int, int], ...]  # (start, stop) per dimension.

# Longest excerpt of a storage library's error message put into a CheckpointError.
_MAX_CAUSE = 160


def checksum(data: Any) -> int:
    """CRC32 of the C-order bytes of `data`."""
    flat = np.ascontiguousarray(np.asarray(data)).reshape(-1)
    return zlib.crc32(flat.view(np.uint8))


def json_checksum(value: Any) -> int:
    """CRC32 of the canonical JSON of `value` (sorted keys, no spaces)."""
    return zlib.crc32(json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True).encode())


def normalize(index: tuple, shape: Sequence[int]) -> Index:
    """`(start, stop)` per dimension for a tuple of slices (missing trailing ones = all)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(tuple(s.indices(d)[:2]) for s, d in zip(index, shape))


def piece(index: Index, data: Any) -> dict:
    return {"index": [list(r) for r in index], "crc32": checksum(data)}


_GOLDEN = 0x9E3779B9  # mix32's position multiplier (2**32 / golden ratio).
MIX32_BLOCK = 1 << 16  # Words per NumPy block in `mix32`: fits the CPU cache, so each pass is cheap.


def mix32(data: Any) -> int:
    """The `mix32` checksum of `data`'s C-order elements (see the module docstring)."""
    words = _host_words(np.ascontiguousarray(np.asarray(data)).reshape(-1))
    offsets = np.arange(min(MIX32_BLOCK, words.size), dtype=np.uint32) * np.uint32(_GOLDEN)
    h, t = np.empty_like(offsets), np.empty_like(offsets)
    total = 0
    for start in range(0, words.size, MIX32_BLOCK):
        n = min(MIX32_BLOCK, words.size - start)
        hh, tt = h[:n], t[:n]
        np.add(offsets[:n], np.uint32(start * _GOLDEN % 2**32), out=hh)  # (start + i) * golden.
        np.bitwise_xor(hh, words[start : start + n], out=hh)
        for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):  # fmix32.
            np.right_shift(hh, shift, out=tt)
            np.bitwise_xor(hh, tt, out=hh)
            if multiplier is not None:
                np.multiply(hh, np.uint32(multiplier), out=hh)
        total += int(hh.sum(dtype=np.uint64))
    return total % 2**32


def _host_words(flat: np.ndarray) -> np.ndarray:
    """`mix32`'s words of a 1-D contiguous array: unsigned, one per element (two for 8 bytes)."""
    size = flat.dtype.itemsize
    if size == 8:
        return flat.view(np.uint32)  # Little-endian: low half first, as on the device.
    return flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])


@functools.cache
def device_checksummable(dtype: Any) -> bool:
    """Whether `start_checksums` computes `mix32` of arrays of `dtype` on their device.

    Booleans, integers and floats whose width is a whole 1, 2, 4 or 8 bytes; not
    sub-byte types (int4, float4) or complex numbers, which are checksummed on the host.
    """
    if np.dtype(dtype) == np.bool_:
        return True
    for kind, info in ((jax.numpy.integer, jax.numpy.iinfo), (jax.numpy.floating, jax.numpy.finfo)):
        if jax.numpy.issubdtype(dtype, kind):
            return np.dtype(dtype).itemsize in (1, 2, 4, 8) and info(dtype).bits == 8 * np.dtype(dtype).itemsize
    return False


def _device_mix32(x: jax.Array) -> jax.Array:
    """`mix32` of one array, traced (the device-side twin of `mix32`)."""
    jnp, lax = jax.numpy, jax.lax
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint8)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
        words = lax.bitcast_convert_type(x, unsigned)
        if x.dtype.itemsize == 8:
            words = lax.bitcast_convert_type(words, jnp.uint32)  # (..., 2): low half first.
    words = words.reshape(-1).astype(jnp.uint32)
    h = words ^ (lax.iota(jnp.uint32, words.size) * jnp.uint32(_GOLDEN))
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return jnp.sum(h, dtype=jnp.uint32)  # Integer sums wrap: mod 2**32.


@functools.cache
def _device_program() -> Callable[[tuple], jax.Array]:
    """One jitted program: the `mix32` of each of a tuple of arrays (one device's shards)."""
    return jax.jit(lambda xs: jax.numpy.stack([_device_mix32(x) for x in xs]))


class PendingChecksums:
    """The checksums of the pieces one process saves, computed on the device(s).

    `PendingChecksums(state)` looks at the state (which shards, on which devices: no
    device work); `dispatch()` (the training thread, before `save` returns) launches
    the computation and returns at once; `result()` (a background thread) waits for
    it and returns `{path: [piece, ...]}`: `{"index", "mix32"}` pieces, plus
    `{"index", "crc32"}` ones for host data and for dtypes the device program does not
    handle. `abandon(error)` makes a waiting `result()` raise instead.

    NumPy leaves (and Python scalars) are host data, which process 0 checksums at
    construction with CRC32, as it does the rare arrays whose dtype
    `device_checksummable` declines (a blocking device-to-host copy of those only).
    Tree paths and indices are worked out in `result()`, off the training thread.
    """

    # How long `result()` waits for `dispatch` or `abandon` (they follow within one `save`).
    TIMEOUT_S = 600.0

    def __init__(self, state: Any):
        self._started = threading.Event()
        self._error: BaseException | None = None
        leaves, self._treedef = jax.tree.flatten(state)
        self._shapes = [tuple(np.shape(x)) for x in leaves]
        self._host: list[tuple[int, dict]] = []  # (leaf number, piece).
        self._by_device: dict[Any, tuple[list[jax.Array], list[tuple[int, tuple | None]]]] = {}
        self._device: list[tuple[jax.Array, list[tuple[int, tuple | None]]]] = []  # (values, [(leaf, index)]).
        primary = jax.process_index() == 0
        for n, x in enumerate(leaves):
            if not isinstance(x, jax.Array):
                if primary:
                    value = np.asarray(x)
                    self._host.append((n, piece(normalize((), value.shape), value)))
                continue
            if isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
                shards = [(None, x, next(iter(x.sharding.device_set)))]  # Skips building Shard objects.
            else:
                shards = [(s.index, s.data, s.device) for s in x.addressable_shards if s.replica_id == 0]
            for index, data, device in shards:
                if not device_checksummable(x.dtype):
                    self._host.append((n, piece(normalize(index or (), x.shape), np.asarray(data))))
                    continue
                arrays, where = self._by_device.setdefault(device, ([], []))
                arrays.append(data)
                where.append((n, index))

    def dispatch(self) -> None:
        """Launches one jitted call per local device that holds replica-0 shards.

        The call is asynchronous: it returns before the device has run it, and since it
        is dispatched before any later computation, a later step that donates the
        state's buffers runs after it has read them. Does nothing if already
        dispatched or abandoned.
        """
        if self._started.is_set():
            return
        try:
            program = _device_program()
            self._device = [(program(tuple(arrays)), where) for arrays, where in self._by_device.values()]
        except BaseException as e:
            self.abandon(e)
            raise
        finally:
            self._by_device = {}  # The arrays are the device program's now; hold no references.
        self._started.set()

    def abandon(self, error: BaseException) -> None:
        if not self._started.is_set():
            self._error = error
            self._by_device = {}
            self._started.set()

    def result(self) -> dict[str, list[dict]]:
        if not self._started.wait(self.TIMEOUT_S):
            raise TimeoutError(f"the checksums were not dispatched within {self.TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"computing the checksums failed: {self._error!r}")
        numbered = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(self._treedef, range(len(self._shapes))))[0]
        paths = [jax.tree_util.keystr(p) for p, _ in numbered]
        pieces: dict[str, list[dict]] = {path: [] for path in paths}
        for n, p in self._host:
            pieces[paths[n]].append(p)
        for values, where in self._device:
            for value, (n, index) in zip(np.asarray(values).tolist(), where):  # Waits for the device.
                rows = normalize(index or (), self._shapes[n])
                pieces[paths[n]].append({"index": [list(r) for r in rows], "mix32": int(value)})
        return pieces


def start_checksums(state: Any) -> PendingChecksums:
    """Checksums of this process's replica-0 shards of `state`, dispatched (see `PendingChecksums`)."""
    pending = PendingChecksums(state)
    pending.dispatch()
    return pending


def host_regions(x: jax.Array) -> list[tuple[Index, np.ndarray]]:
    """This process's host copies of the distinct addressable shards of a restored array."""
    shape, seen, out = tuple(x.shape), set(), []
    for s in x.addressable_shards:
        index = normalize(s.index, shape)
        if index not in seen:
            seen.add(index)
            out.append((index, np.asarray(s.data)))
    return out


def verify_pieces(
    path: str,
    pieces: Sequence[dict],
    regions: Sequence[tuple[Index, np.ndarray]],
    where: str,
    file: str,
    read: Callable[[Index], np.ndarray] | None = None,
    wanted: Sequence[Index] | None = None,
) -> None:
    """Raises CheckpointError if a saved piece of leaf `path` differs from what was read.

    Each piece is checked against a read region that contains it; failing that, if it
    overlaps `wanted` (default: the regions) and `read` is given, it is read on its own.
    """
    wanted = [r for r, _ in regions] if wanted is None else wanted
    for p in pieces:
        index = tuple(tuple(r) for r in p["index"])
        data = _slice_from(index, regions)
        if data is None:
            if read is None or not any(_overlaps(index, w) for w in wanted):
                continue
            data = read(index)
        if not _matches(p, data):
            rows = ",".join(f"{a}:{b}" for a, b in index)
            raise CheckpointError(
                f"Checkpoint {where} failed verification: {path} [{rows}] in {file} does not match "
                f"its checksum (corrupt or changed file).",
                reason=f"{path} in {file} does not match its checksum",
            )


def _matches(p: dict, data: np.ndarray) -> bool:
    """Whether `data` has the checksum recorded in piece `p` (by its algorithm's key)."""
    if "mix32" in p:
        return mix32(data) == p["mix32"]
    if "crc32" in p:
        return checksum(data) == p["crc32"]
    return False  # An algorithm this version does not know: never trusted.


def _slice_from(index: Index, regions: Sequence[tuple[Index, np.ndarray]]) -> np.ndarray | None:
    for region, data in regions:
        if all(ra <= a and b <= rb for (a, b), (ra, rb) in zip(index, region)):
            return data[tuple(slice(a - ra, b - ra) for (a, b), (ra, _) in zip(index, region))]
    return None


def _overlaps(a: Index, b: Index) -> bool:
    return all(x0 < y1 and y0 < x1 or x0 == x1 == y0 == y1 for (x0, x1), (y0, y1) in zip(a, b))


def verify_metadata(metadata: Any, expected: int | None, where: str, file: str) -> None:
    if expected is not None and json_checksum(metadata) != expected:
        raise CheckpointError(
            f"Checkpoint {where} failed verification: the metadata (input-pipeline state) in {file} "
            f"does not match its checksum.",
            reason=f"metadata in {file} does not match its checksum",
        )


def cause(e: BaseException) -> str:
    """One short line from a storage library's exception: no spec dumps, no source locations."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner  # The storage library's own error, not orbax's wrapper of it.
    text = one_line(e)
    text = re.split(r"\s*See full TensorStore details", text, maxsplit=1)[0]
    text = re.split(r"\s*\[(?:source locations|tensorstore_spec)", text, maxsplit=1)[0]
    text = re.sub(r"\{.*\}", "{...}", text)  # JSON specs.
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= _MAX_CAUSE else text[: _MAX_CAUSE - 3] + "..."
