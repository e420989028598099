"""axcore.data.shards: the prepared-shard format, read back by PreparedShards and by plain NumPy."""

import json
import os
import pickle

import numpy as np
import pytest

from axcore.data import DataError
from axcore.data.shards import (
    INDEX_FILE,
    PreparedShards,
    array_file,
    foreign_entries,
    read_done,
    shard_name,
    token_dtype,
    write_index,
    write_shard,
)

FINGERPRINT = {"name": "ByteTokenizer", "vocab_size": 256, "sha256": "ab" * 32}


def _documents(seed: int, count: int, masked: bool):
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        n = int(rng.integers(0, 40))
        doc = {"tokens": rng.integers(0, 256, n).astype(np.int32)}
        if masked:
            doc["loss_mask"] = rng.integers(0, 2, n).astype(np.uint8)
        docs.append(doc)
    return docs


def _write(directory, shards_of_docs, masked=False):
    """Writes each list of documents as one shard (the way prepare does) and the index; returns the records."""
    records = []
    for s, docs in enumerate(shards_of_docs):
        tokens = np.concatenate([d["tokens"] for d in docs] + [np.zeros(0, np.int32)]).astype("<u2")
        offsets = np.concatenate([[0], np.cumsum([len(d["tokens"]) for d in docs])]).astype(np.int64)
        mask = np.concatenate([d["loss_mask"] for d in docs] + [np.zeros(0, np.uint8)]) if masked else None
        records.append(write_shard(str(directory), shard_name(s), tokens, offsets, mask, {"unit": s}))
    write_index(str(directory), FINGERPRINT, np.dtype("<u2"), masked, records, ["in.jsonl"], "test")
    return records


@pytest.mark.parametrize("masked", [False, True])
def test_documents_read_back_across_shards(tmp_path, masked):
    parts = [_documents(1, 5, masked), _documents(2, 0, masked), _documents(3, 7, masked)]
    _write(tmp_path, parts, masked)
    flat = [d for part in parts for d in part]
    shards = PreparedShards(str(tmp_path))
    assert (shards.num_documents, shards.num_shards, shards.has_loss_mask) == (12, 3, masked)
    assert shards.num_tokens == sum(len(d["tokens"]) for d in flat)
    assert shards.fingerprint == FINGERPRINT and shards.dtype == np.uint16
    np.testing.assert_array_equal(shards.document_lengths(), [len(d["tokens"]) for d in flat])
    for i, want in enumerate(flat):
        got = shards.document(i)
        assert got["tokens"].dtype == np.int32
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
        assert ("loss_mask" in got) == masked
        if masked:
            np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])
    with pytest.raises(IndexError):
        shards.document(12)
    again = pickle.loads(pickle.dumps(shards))
    np.testing.assert_array_equal(again.document(11)["tokens"], flat[11]["tokens"])
    shards.verify()


def test_files_are_plain_npy_and_the_index_follows_the_documented_layout(tmp_path):
    parts = [_documents(4, 3, True)]
    records = _write(tmp_path, parts, masked=True)
    tokens = np.load(tmp_path / "shard-00000.tokens.npy")
    offsets = np.load(tmp_path / "shard-00000.offsets.npy")
    mask = np.load(tmp_path / "shard-00000.loss_mask.npy")
    assert (tokens.dtype, offsets.dtype, mask.dtype) == (np.uint16, np.int64, np.uint8)
    np.testing.assert_array_equal(tokens[offsets[1] : offsets[2]], parts[0][1]["tokens"])
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["format"] == "axcore.shards/1" and index["dtype"] == "uint16" and index["loss_mask"] is True
    assert index["documents"] == 3 and index["tokens"] == len(tokens)
    import hashlib

    for kind in ("tokens", "offsets", "loss_mask"):
        want = hashlib.sha256((tmp_path / array_file("shard-00000", kind)).read_bytes()).hexdigest()
        assert index["shards"][0]["sha256"][kind] == want == records[0]["sha256"][kind]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["index.json", "shard-00000.done.json"] + [f"shard-00000.{k}.npy" for k in ("tokens", "offsets", "loss_mask")]
    )
    assert foreign_entries(str(tmp_path)) == []


def test_read_done_matches_only_the_same_unit_and_sizes(tmp_path):
    _write(tmp_path, [_documents(5, 4, False)])
    assert read_done(str(tmp_path), "shard-00000", {"unit": 0})["documents"] == 4
    assert read_done(str(tmp_path), "shard-00000", {"unit": 1}) is None
    path = tmp_path / "shard-00000.tokens.npy"
    path.write_bytes(path.read_bytes()[:-2])
    assert read_done(str(tmp_path), "shard-00000", {"unit": 0}) is None


def test_token_dtype():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_missing_index_and_other_format(tmp_path):
    with pytest.raises(DataError, match=r"input\.source\.path '.*' has no index\.json.*re-run, it resumes"):
        PreparedShards(str(tmp_path), field="input.source.path")
    (tmp_path / INDEX_FILE).write_text('{"format": "other/2"}')
    with pytest.raises(DataError, match=r"has format 'other/2', not 'axcore.shards/1'"):
        PreparedShards(str(tmp_path))
    with pytest.raises(DataError, match=r"is not a directory"):
        PreparedShards(str(tmp_path / "nope"))


@pytest.mark.parametrize("kind", ["tokens", "offsets"])
def test_truncated_file_is_refused_at_open_naming_it(tmp_path, kind):
    _write(tmp_path, [_documents(6, 4, False), _documents(7, 4, False)])
    path = tmp_path / array_file("shard-00001", kind)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataError, match=rf"'{path}' has \d+ bytes, its header says \d+ \(truncated"):
        PreparedShards(str(tmp_path))


def test_missing_shard_file_and_mismatched_counts(tmp_path):
    _write(tmp_path, [_documents(8, 4, False)])
    original = (tmp_path / INDEX_FILE).read_text()
    index = json.loads(original)
    index["shards"][0]["tokens"] += 1
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"shard-00000.tokens.npy' holds uint16 \[\d+\], index.json says"):
        PreparedShards(str(tmp_path))
    (tmp_path / INDEX_FILE).write_text(original)
    PreparedShards(str(tmp_path))
    os.remove(tmp_path / "shard-00000.offsets.npy")
    with pytest.raises(DataError, match=r"shard-00000.offsets.npy' is missing"):
        PreparedShards(str(tmp_path))


def test_offsets_that_do_not_end_at_the_token_count_are_refused(tmp_path):
    docs = _documents(9, 4, False)
    _write(tmp_path, [docs])
    path = tmp_path / "shard-00000.offsets.npy"
    offsets = np.load(path)
    offsets[-1] -= 1
    np.save(path, offsets)
    with pytest.raises(DataError, match=r"offsets.npy' runs from 0 to \d+, not 0 to"):
        PreparedShards(str(tmp_path))


def test_verify_finds_a_flipped_byte(tmp_path):
    _write(tmp_path, [_documents(10, 6, False)])
    shards = PreparedShards(str(tmp_path))
    shards.verify()
    path = tmp_path / "shard-00000.tokens.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"tokens.npy' does not match its sha256"):
        PreparedShards(str(tmp_path)).verify()


def test_check_tokenizer(tmp_path):
    _write(tmp_path, [_documents(11, 2, False)])
    shards = PreparedShards(str(tmp_path))
    shards.check_tokenizer(dict(FINGERPRINT), "input.source")
    with pytest.raises(DataError, match=r"input\.source: .*vocab 256.*vocab 512.*\(vocab size differs\)"):
        shards.check_tokenizer({**FINGERPRINT, "vocab_size": 512}, "input.source")
    with pytest.raises(DataError, match=r"\(tokenizer differs\)"):
        shards.check_tokenizer({**FINGERPRINT, "sha256": "cd" * 32}, "input.source")


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_a_flipped_byte_stops_every_read_once_found_naming_its_file(tmp_path, monkeypatch):
    """Sizes and headers pass (the byte is inside the data); the background sha256 check refuses the shard,
    and once it is known corrupt, every read (of any shard) refuses with the same line."""
    import threading

    from axcore.data import shard_hashes

    parts = [_documents(20, 4, False), _documents(21, 5, False)]
    _write(tmp_path, parts)
    _flip_last_byte(tmp_path / "shard-00001.tokens.npy")
    hashed_on = []
    real = shard_hashes.file_sha256
    monkeypatch.setattr(shard_hashes, "file_sha256", lambda p: hashed_on.append(threading.current_thread().name) or real(p))
    shards = PreparedShards(str(tmp_path))  # Opens: the cheap checks pass.
    assert hashed_on == []  # Nothing hashed at open.
    message = r"shard-00001\.tokens\.npy' does not match its sha256 in index\.json \(corrupted\)"
    for i in (4, 8, 0, 3):  # The corrupt shard's documents, then the intact shard's: all refused.
        with pytest.raises(DataError, match=message):
            shards.document(i)
    # Reads of the intact shard refuse at once (a shard is known corrupt) while a thread may still be hashing
    # it: wait for the hashing threads to end before counting.
    for thread in threading.enumerate():
        if thread.name.startswith("axcore-shard-sha256"):
            thread.join(timeout=60)
    # Each file hashed once (2 shards x tokens and offsets), never on the reading thread.
    assert len(hashed_on) == 4 and all(name.startswith("axcore-shard-sha256") for name in hashed_on), hashed_on


def test_intact_shards_read_after_their_check(tmp_path):
    parts = [_documents(23, 4, False), _documents(24, 5, False)]
    _write(tmp_path, parts)
    shards = PreparedShards(str(tmp_path))
    for i, want in enumerate([d for part in parts for d in part]):
        np.testing.assert_array_equal(shards.document(i)["tokens"], want["tokens"])


def test_the_sha256_check_survives_pickling_and_a_restored_copy_checks_again(tmp_path):
    _write(tmp_path, [_documents(22, 3, False)])
    shards = PreparedShards(str(tmp_path))
    shards.document(0)  # Checked and matched here.
    _flip_last_byte(tmp_path / "shard-00000.tokens.npy")
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(shards)).document(1)["tokens"], shards.document(1)["tokens"])
    with pytest.raises(DataError, match=r"shard-00000\.tokens\.npy' does not match its sha256"):
        pickle.loads(pickle.dumps(PreparedShards(str(tmp_path)))).document(0)
