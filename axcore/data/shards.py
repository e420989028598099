"""Prepared token shards: the on-disk format `axcore prepare` writes and training reads.

A prepared dataset is a directory (documented in docs/data.md, "The shard format"):

    index.json                     written last, atomically: the dataset is complete only when it exists
    shard-00000.tokens.npy         1-D uint16 or uint32 token ids of the shard's documents, concatenated
    shard-00000.offsets.npy        int64 [documents + 1]; document k is tokens[off[k]:off[k+1]]
    shard-00000.loss_mask.npy      uint8 [tokens], only for masked (chat) data
    shard-00000.done.json          the shard's completion record (counts, sha256 of each file)
    prepare.json                   what `axcore prepare` was asked to do (resume refuses other arguments)

Every file is a plain NumPy `.npy` (little-endian), so any tool reads a shard with
`np.load(path, mmap_mode="r")`. Files are written under temporary names, fsynced and
renamed; a shard counts as finished only once its `done.json` exists (written after
its arrays), and the dataset only once `index.json` exists (written after every
shard). So a killed writer never leaves anything that looks finished.

`PreparedShards` opens a dataset in O(number of shards): it reads index.json and the
`.npy` headers (checking shapes, dtypes and file sizes against the index) and maps a
shard's arrays only when a document of it is read; nothing is hashed at open. Before
a shard's first document is returned, its files' sha256 must have matched index.json:
they are hashed once, in background threads that start at the first read and go on
through the other shards (`axcore.data.shard_hashes`), so a flipped byte stops the
first read of its shard with one DataError naming the file, and no document of a
corrupt shard is ever used. `verify()` hashes everything at once, on request.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from collections.abc import Mapping

import numpy as np

from axcore.data.errors import DataError
from axcore.data.shard_hashes import ShardHashes, file_sha256

# The value of index.json's "format"; a reader refuses any other.
SHARDS_FORMAT = "axcore.shards/1"
INDEX_FILE = "index.json"
# What `axcore prepare` was asked to do (inputs, tokenizer, options), written before any shard.
PREPARE_FILE = "prepare.json"
# Kinds of arrays in a shard, and their dtypes ("tokens" is uint16 or uint32).
ARRAY_KINDS = ("tokens", "offsets", "loss_mask")
_KIND_DTYPES = {"offsets": np.dtype("<i8"), "loss_mask": np.dtype("u1")}
# Names a prepared directory may hold (anything else means it holds something else).
_OWN_FILE = re.compile(
    r"^(index\.json|prepare\.json|shard-\d{5,}\.(tokens\.npy|offsets\.npy|loss_mask\.npy|done\.json))(\.tmp-\d+)?$"
)
_TMP = re.compile(r"\.tmp-\d+$")
# Shards whose arrays stay mapped at once (each map holds a file descriptor).
_OPEN_SHARDS = 64


def shard_name(index: int) -> str:
    """The name of shard `index`: "shard-00000"."""
    return f"shard-{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids 0..vocab_size-1: uint16 up to 65,536 ids, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def array_file(name: str, kind: str) -> str:
    """File name of one array of a shard: `array_file("shard-00000", "tokens") == "shard-00000.tokens.npy"`."""
    return f"{name}.{kind}.npy"


def done_file(name: str) -> str:
    """File name of a shard's completion record."""
    return f"{name}.done.json"


def foreign_entries(directory: str) -> list[str]:
    """Entries of `directory` that a prepared dataset never holds (sorted)."""
    return sorted(e for e in os.listdir(directory) if not _OWN_FILE.match(e))


def remove_temporary_files(directory: str) -> None:
    """Removes the temporary files a killed writer left behind."""
    for entry in os.listdir(directory):
        if _TMP.search(entry) and _OWN_FILE.match(entry):
            os.remove(os.path.join(directory, entry))


class _HashingWriter:
    """A write-only file object that hashes what goes through it (so files are hashed while written)."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += len(view)
        return self._f.write(view)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomically(path: str, data: Mapping) -> None:
    """Writes `data` as JSON to `path`: temporary file, fsync, `os.replace`, fsync of the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_directory(os.path.dirname(path) or ".")


def _write_array(path: str, array: np.ndarray) -> dict:
    """Writes `array` as `.npy` under a temporary name, fsyncs and renames it; returns its {"bytes", "sha256"}."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        np.lib.format.write_array(writer, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


def write_shard(
    directory: str, name: str, tokens: np.ndarray, offsets: np.ndarray, loss_mask: np.ndarray | None, extra: Mapping
) -> dict:
    """Writes one shard's arrays, then its done.json; returns the done record.

    `tokens` is 1-D uint16/uint32 `[T]`, `offsets` int64 `[D + 1]` (0 first, T last,
    non-decreasing), `loss_mask` uint8 `[T]` or None. `extra` (JSON-safe) is stored in
    the record under "unit" (what the shard was made from), so a resume can tell that
    an existing shard is the one it would write.
    """
    if offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != len(tokens):
        raise ValueError(f"{name}: offsets must run from 0 to {len(tokens)} tokens.")
    arrays = {"tokens": tokens, "offsets": offsets.astype("<i8", copy=False)}
    if loss_mask is not None:
        if loss_mask.shape != tokens.shape:
            raise ValueError(f"{name}: loss_mask {loss_mask.shape} must have the shape of tokens {tokens.shape}.")
        arrays["loss_mask"] = loss_mask.astype("u1", copy=False)
    files = {kind: _write_array(os.path.join(directory, array_file(name, kind)), a) for kind, a in arrays.items()}
    record = {
        "name": name,
        "documents": int(len(offsets) - 1),
        "tokens": int(len(tokens)),
        "dtype": np.dtype(tokens.dtype).name,
        "bytes": {kind: f["bytes"] for kind, f in files.items()},
        "sha256": {kind: f["sha256"] for kind, f in files.items()},
        "unit": dict(extra),
    }
    write_json_atomically(os.path.join(directory, done_file(name)), record)
    return record


def write_index(
    directory: str,
    fingerprint: Mapping,
    dtype: np.dtype,
    loss_mask: bool,
    records: list[dict],
    inputs: list,
    created_by: str,
    extra: Mapping | None = None,
) -> dict:
    """Writes index.json (atomically; call it after every shard is done) from the shards' done records; returns it.

    `extra` (JSON-safe) adds keys, e.g. "chat" (the template's sha256 and `train_on`).
    """
    index = {
        **dict(extra or {}),
        "format": SHARDS_FORMAT,
        "tokenizer": dict(fingerprint),
        "dtype": np.dtype(dtype).name,
        "loss_mask": bool(loss_mask),
        "documents": int(sum(r["documents"] for r in records)),
        "tokens": int(sum(r["tokens"] for r in records)),
        "shards": [
            {"name": r["name"], "documents": r["documents"], "tokens": r["tokens"], "sha256": r["sha256"]} for r in records
        ],
        "inputs": list(inputs),
        "created_by": created_by,
    }
    write_json_atomically(os.path.join(directory, INDEX_FILE), index)
    return index


def read_done(directory: str, name: str, unit: Mapping) -> dict | None:
    """The shard's done record if it exists, describes `unit` and its files have the recorded sizes; else None.

    Sizes only (cheap): the sha256 of every file is checked by `PreparedShards.verify`.
    """
    try:
        with open(os.path.join(directory, done_file(name)), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("unit") != dict(unit):
        return None
    for kind, size in dict(record.get("bytes") or {}).items():
        path = os.path.join(directory, array_file(name, kind))
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return None
    return record


def _read_header(path: str, where: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, data offset) of a `.npy` file, checking that the file holds all its data."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            data_offset = f.tell()
    except FileNotFoundError:
        raise DataError(f"{where}: '{path}' is missing; re-run axcore prepare into this directory (it resumes).") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: '{path}' is not a readable .npy file ({e}); re-run axcore prepare.") from None
    size = os.path.getsize(path)
    expected = data_offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if fortran or len(shape) != 1 or size != expected:
        problem = f"has {size} bytes, its header says {expected}" if size != expected else "is not a 1-D array"
        raise DataError(f"{where}: '{path}' {problem} (truncated or corrupted); re-run axcore prepare.")
    return dtype, shape, data_offset


class PreparedShards:
    """A prepared dataset opened for random access by document.

    Documents are numbered 0..num_documents-1 across shards in shard order. Opening
    reads index.json and each file's `.npy` header (O(number of shards)); `document(i)`
    maps the shard's arrays on first use (at most `_OPEN_SHARDS` shards stay mapped).
    Picklable (the maps are reopened in the receiving process).

    Raises (at open):
        DataError: naming `field` and the file: no index.json (not prepared, or
            unfinished), another format, a missing or truncated file, counts or
            dtypes that disagree with the index, offsets that do not end at the
            shard's token count.
    """

    def __init__(self, path: str, *, field: str = "path"):
        self.path = os.path.expanduser(path)
        self._field = field
        index_path = os.path.join(self.path, INDEX_FILE)
        where = f"{field} '{self.path}'"
        if not os.path.isdir(self.path):
            raise DataError(f"{where} is not a directory; point it at a directory written by axcore prepare.")
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except FileNotFoundError:
            raise DataError(
                f"{where} has no {INDEX_FILE}: it is not a prepared dataset, or axcore prepare did not finish; "
                f"run (or re-run, it resumes) axcore prepare --output {self.path}."
            ) from None
        except (OSError, ValueError) as e:
            raise DataError(f"{where}: '{index_path}' cannot be read ({e}); re-run axcore prepare.") from None
        if not isinstance(index, dict) or index.get("format") != SHARDS_FORMAT:
            got = index.get("format") if isinstance(index, dict) else type(index).__name__
            raise DataError(f"{where}: '{index_path}' has format {got!r}, not {SHARDS_FORMAT!r}; re-run axcore prepare.")
        try:
            self.index = index
            self.fingerprint: dict = dict(index["tokenizer"])
            self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
            self.has_loss_mask = bool(index["loss_mask"])
            shards = list(index["shards"])
            names = [str(s["name"]) for s in shards]
            counts = np.array([int(s["documents"]) for s in shards], dtype=np.int64)
            token_counts = [int(s["tokens"]) for s in shards]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: '{index_path}' lacks or mangles {e}; re-run axcore prepare.") from None
        if self.dtype not in (np.dtype("<u2"), np.dtype("<u4")):
            raise DataError(f"{where}: '{index_path}' has dtype {self.dtype}; prepared tokens are uint16 or uint32.")
        kinds = ARRAY_KINDS if self.has_loss_mask else ARRAY_KINDS[:2]
        self._headers: list[dict[str, int]] = []  # Per shard: kind -> data offset in its file.
        for name, documents, tokens in zip(names, counts, token_counts):
            offsets = {}
            for kind in kinds:
                file = os.path.join(self.path, array_file(name, kind))
                dtype, shape, offsets[kind] = _read_header(file, where)
                want_dtype = self.dtype if kind == "tokens" else _KIND_DTYPES[kind]
                want_len = documents + 1 if kind == "offsets" else tokens
                if dtype != want_dtype or shape[0] != want_len:
                    raise DataError(
                        f"{where}: '{file}' holds {dtype} [{shape[0]}], index.json says {want_dtype} [{want_len}]; "
                        f"the directory mixes two preparations; re-run axcore prepare into an empty directory."
                    )
            self._headers.append(offsets)
        self._names = names
        self._tokens_per_shard = token_counts
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # First document of each shard.
        self.num_documents = int(self._first[-1])
        self.num_tokens = int(sum(token_counts))
        self._maps: collections.OrderedDict[int, dict[str, np.ndarray]] = collections.OrderedDict()
        for shard in range(len(names)):  # Offsets must start at 0 and end at the token count: two reads each.
            off = self._arrays(shard)["offsets"]
            if len(off) and (off[0] != 0 or off[-1] != token_counts[shard]):
                raise DataError(
                    f"{where}: '{os.path.join(self.path, array_file(names[shard], 'offsets'))}' runs from {off[0]} to "
                    f"{off[-1]}, not 0 to {token_counts[shard]} tokens (corrupted); re-run axcore prepare."
                )
        self._maps.clear()
        self._hashes = ShardHashes(
            [
                [(os.path.join(self.path, array_file(name, kind)), str(want)) for kind, want in sorted(sha.items())]
                for name, sha in zip(names, self._recorded_sha256(index_path))
            ],
            self._corrupt,
        )

    def _recorded_sha256(self, index_path: str) -> list[dict[str, str]]:
        """Per shard, `{kind: sha256}` from index.json (empty where it records none)."""
        try:
            return [dict(entry.get("sha256") or {}) for entry in self.index["shards"]]
        except (AttributeError, TypeError, ValueError) as e:
            raise DataError(f"{self._field} '{self.path}': '{index_path}' mangles a shard's sha256 ({e}); "
                            f"re-run axcore prepare.") from None

    def _corrupt(self, path: str, problem: str) -> str:
        """The message of the DataError for a shard file that fails its sha256 check."""
        return (
            f"{self._field} '{self.path}': '{path}' {problem} (corrupted); delete the shard's files and its "
            f"done.json and re-run axcore prepare (it redoes that shard), or check with axcore prepare --verify."
        )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"] = collections.OrderedDict()
        return state

    @property
    def num_shards(self) -> int:
        """Number of shard files sets."""
        return len(self._names)

    def _arrays(self, shard: int) -> dict[str, np.ndarray]:
        """The shard's arrays as read-only memory maps (least recently used maps are closed)."""
        arrays = self._maps.get(shard)
        if arrays is None:
            arrays = {}
            for kind, offset in self._headers[shard].items():
                dtype = self.dtype if kind == "tokens" else _KIND_DTYPES[kind]
                file = os.path.join(self.path, array_file(self._names[shard], kind))
                count = (os.path.getsize(file) - offset) // dtype.itemsize
                arrays[kind] = (
                    np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count else np.zeros(0, dtype)
                )
            self._maps[shard] = arrays
            if len(self._maps) > _OPEN_SHARDS:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(shard)
        return arrays

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range 0..{self.num_documents - 1}")
        shard = int(np.searchsorted(self._first, i, side="right")) - 1
        return shard, i - int(self._first[shard])

    def document(self, i: int) -> dict:
        """Document `i`: `{"tokens": int32 [n]}` plus `"loss_mask": uint8 [n]` when the data has masks (copies)."""
        shard, k = self._locate(int(i))
        self._hashes.require(shard)  # Never a document of a shard whose files fail their sha256.
        arrays = self._arrays(shard)
        start, end = int(arrays["offsets"][k]), int(arrays["offsets"][k + 1])
        if not 0 <= start <= end <= self._tokens_per_shard[shard]:
            file = os.path.join(self.path, array_file(self._names[shard], "offsets"))
            raise DataError(f"{self._field} '{self.path}': '{file}' entry {k} is corrupted ({start}..{end}); re-run axcore prepare.")
        out = {"tokens": np.asarray(arrays["tokens"][start:end], dtype=np.int32)}
        if self.has_loss_mask:
            out["loss_mask"] = np.array(arrays["loss_mask"][start:end], dtype=np.uint8)
        return out

    def document_lengths(self) -> np.ndarray:
        """int64 `[num_documents]`: the token count of every document (reads the offsets files)."""
        for shard in range(self.num_shards):
            self._hashes.require(shard)
        parts = [np.diff(np.asarray(self._arrays(s)["offsets"], np.int64)) for s in range(self.num_shards)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def check_tokenizer(self, fingerprint: Mapping, where: str) -> None:
        """Raises DataError naming `where` when `fingerprint` (the experiment's tokenizer) differs from the shards'."""
        if dict(fingerprint) == self.fingerprint:
            return
        mine, theirs = self.fingerprint, dict(fingerprint)

        def describe(f: Mapping) -> str:
            return f"{f.get('name')} (vocab {f.get('vocab_size')}, sha256 {str(f.get('sha256'))[:12]})"

        what = "vocab size" if mine.get("vocab_size") != theirs.get("vocab_size") else "tokenizer"
        raise DataError(
            f"{where}: the shards in '{self.path}' were prepared with tokenizer {describe(mine)}, the experiment uses "
            f"{describe(theirs)} ({what} differs); re-run axcore prepare with the experiment's tokenizer "
            f"(--experiment) or train with the tokenizer the shards were made with."
        )

    def verify(self) -> None:
        """Checks the sha256 of every file against index.json and every token id against the vocab size.

        Raises:
            DataError: naming the first file that does not match.
        """
        vocab = self.fingerprint.get("vocab_size")
        for shard, entry in enumerate(self.index["shards"]):
            for kind, want in dict(entry.get("sha256", {})).items():
                file = os.path.join(self.path, array_file(self._names[shard], kind))
                if file_sha256(file) != want:
                    raise DataError(self._corrupt(file, "does not match its sha256 in index.json"))
            arrays = self._arrays(shard)
            if np.any(np.diff(np.asarray(arrays["offsets"])) < 0):
                raise DataError(f"{self._field} '{self.path}': shard {self._names[shard]} has decreasing offsets.")
            if vocab is not None and len(arrays["tokens"]) and int(arrays["tokens"].max()) >= int(vocab):
                raise DataError(
                    f"{self._field} '{self.path}': shard {self._names[shard]} holds token id "
                    f"{int(arrays['tokens'].max())} >= the tokenizer's vocab size {vocab}."
                )


def claim_output_directory(output: str, run: dict) -> bool:
    """Makes `output` ready for a prepare run (`run`: its arguments, saved as PREPARE_FILE); True when it
    already holds the finished dataset of this run.

    Raises:
        DataError: `output` is a file, holds other files, or was prepared with other arguments.
    """
    if os.path.exists(output) and not os.path.isdir(output):
        raise DataError(f"--output '{output}' is a file; name a new or empty directory.")
    os.makedirs(output, exist_ok=True)
    foreign = foreign_entries(output)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise DataError(
            f"--output '{output}' holds other files ({', '.join(foreign[:3])}{more}); "
            f"name a new or empty directory (prepare writes only its shards there)."
        )
    prepare_path = os.path.join(output, PREPARE_FILE)
    if os.path.exists(prepare_path):
        try:
            with open(prepare_path, encoding="utf-8") as f:
                previous = json.load(f)
        except (OSError, ValueError):
            previous = {}
        if previous != run:
            keys = sorted(k for k in set(run) | set(previous or {}) if (previous or {}).get(k) != run.get(k))
            raise DataError(
                f"--output '{output}' was prepared with different {', '.join(keys) or 'arguments'}; repeat that run's "
                f"arguments to resume it, or name a new (or emptied) directory."
            )
        remove_temporary_files(output)
        return os.path.exists(os.path.join(output, INDEX_FILE))
    if os.listdir(output):
        raise DataError(
            f"--output '{output}' holds shards without {PREPARE_FILE} (from another tool or version); "
            f"name a new or empty directory."
        )
    write_json_atomically(prepare_path, run)
    return False
