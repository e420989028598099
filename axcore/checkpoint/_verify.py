"""Checksums of saved arrays and metadata, and their verification on restore.

Each backend records, per array leaf, the CRC32 of the host bytes of every piece it
wrote (`{"index": [[start, stop], ...], "crc32": n}`, one per replica-0 shard; with
several processes each contributes its own shards) and the CRC32 of the metadata's
canonical JSON, in the step's index, which is written before the commit marker. On
restore every piece contained in the host data this process read is checksummed again
and compared; a piece that is not (a finer target sharding, or another process's
shard) is read separately where the backend can, else left unverified.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from axcore.checkpoint.base import CheckpointError

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


def array_pieces(x: Any) -> list[dict]:
    """Checksums of this process's replica-0 shards of `x` (numpy leaves: process 0 only)."""
    if isinstance(x, jax.Array):
        shape = tuple(x.shape)
        return [piece(normalize(s.index, shape), np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0]
    value = np.asarray(x)
    return [piece(normalize((), value.shape), value)] if jax.process_index() == 0 else []


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
        if checksum(data) != p["crc32"]:
            rows = ",".join(f"{a}:{b}" for a, b in index)
            raise CheckpointError(
                f"Checkpoint {where} failed verification: {path} [{rows}] in {file} does not match "
                f"its checksum (corrupt or changed file).",
                reason=f"{path} in {file} does not match its checksum",
            )


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
    text = " ".join(str(e).split())
    text = re.split(r"\s*See full TensorStore details", text, maxsplit=1)[0]
    text = re.split(r"\s*\[(?:source locations|tensorstore_spec)", text, maxsplit=1)[0]
    text = re.sub(r"\{.*\}", "{...}", text)  # JSON specs.
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= _MAX_CAUSE else text[: _MAX_CAUSE - 3] + "..."
