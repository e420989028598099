"""Data sources: registration, the held-out rule, streamed text/JSONL/Parquet/chat files, token files, errors."""

import inspect
import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import axcore
from axcore.config import from_dict, to_dict
from axcore.data import (
    ChatFiles,
    DataError,
    DataSource,
    EmbeddedCorpus,
    InputConfig,
    JsonlFiles,
    ParquetFiles,
    Prepared,
    Split,
    TextFiles,
    TokenDtype,
    TokenFile,
)
from axcore.data.iterator import DocumentStream
from axcore.data.sources import split_indices


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return str(path)


def stream(cfg, split, shard=0, num_shards=1, limit=100):
    """(location, document) of a streamed source's split (at most `limit`; TRAIN is endless), tokenized, in order."""
    source = cfg.instantiate()
    source.use_tokenizer(None)
    items = itertools.islice(DocumentStream(source, split, shard, num_shards), limit)
    return [(loc, source.to_document(loc, raw)) for loc, raw in items]


def text_of(document):
    return bytes(document["tokens"].astype(np.uint8)).decode()


def test_sources_are_registered():
    regs = axcore.create_plugin_manager().registries
    assert regs.data_sources.names() == sorted(["prepared", "embedded_corpus", "text_files", "jsonl_files", "parquet_files", "chat", "token_file"])
    assert regs.lookup("prepared") is Prepared and regs.lookup("jsonl_files") is JsonlFiles


def test_input_config_round_trips_through_registered_names(registries):
    cfg = InputConfig(batch_size=4)
    data = to_dict(cfg, registries)
    assert data["source"] == {"type": "embedded_corpus", "eval_fraction": 0.05}
    assert data["packing"] == "first_fit" and data["long_documents"] == "split"
    assert from_dict(data, registries, InputConfig()) == cfg
    mixture = from_dict(
        {"mixture": [{"name": "web", "weight": 3, "source": {"type": "prepared", "paths": ["/d"]}},
                     {"name": "code", "source": {"type": "token_file", "path": "/x.bin", "dtype": "uint32"}}]},
        registries, InputConfig(),
    )
    assert [c.name for c in mixture.mixture] == ["web", "code"] and mixture.mixture[0].weight == 3.0
    assert mixture.mixture[1].source.klass is TokenFile and mixture.mixture[1].source.dtype is TokenDtype.UINT32


def test_every_config_field_is_documented():
    from axcore.data.mixture import MixtureComponent
    from axcore.data.pipeline import InputConfig as Input

    for cls in (DataSource.Config, EmbeddedCorpus.Config, TextFiles.Config, ChatFiles.Config, TokenFile.Config,
                Prepared.Config, Input, MixtureComponent):
        lines = inspect.getsource(cls).splitlines()
        for i, line in enumerate(lines):
            if ":" in line and "=" in line and not line.strip().startswith(("#", '"', "def", "return")) and line.startswith("    ") and not line.startswith("        "):
                assert lines[i - 1].strip().startswith("#"), f"{cls.__qualname__}: {line.strip()} lacks a comment"


@pytest.mark.parametrize("fraction", [0.05, 0.25, 0.3, 0.5])
def test_the_held_out_rule_spreads_floor_n_f_documents_and_never_overlaps(fraction):
    n = 97
    held_out = [k for k in range(n) if int((k + 1) * fraction) > int(k * fraction)]  # Plain-Python floor.
    assert list(split_indices(n, fraction, Split.EVAL)) == held_out
    assert len(held_out) == int(n * fraction)
    assert sorted([*split_indices(n, fraction, Split.TRAIN), *held_out]) == list(range(n))


def test_the_held_out_rule_across_chunks_in_4_bytes_per_document():
    n, fraction = (1 << 20) + 37, 0.05  # More than one chunk of the computation.
    held_out = [k for k in range(n) if int((k + 1) * fraction) > int(k * fraction)]
    got = split_indices(n, fraction, Split.EVAL)
    assert got.dtype == np.int32 and got.tolist() == held_out
    train = split_indices(n, fraction, Split.TRAIN)
    assert train.dtype == np.int32 and len(train) + len(held_out) == n and not set(held_out) & set(train[-1000:].tolist())


# -- Streamed files -----------------------------------------------------------------------


def test_jsonl_documents_split_and_shard_by_the_rule(tmp_path):
    texts = [f"document number {i}" for i in range(45)]
    cfg = JsonlFiles.default_config().set(paths=[write_jsonl(tmp_path / "a.jsonl", texts)])
    held_out = [19, 39]  # eval_fraction 0.05
    eval_docs = stream(cfg, Split.EVAL)
    assert [loc for loc, _ in eval_docs] == [f"'{tmp_path / 'a.jsonl'}' line {k + 1}" for k in held_out]
    assert text_of(eval_docs[0][1]) == texts[19]
    train = [k for k in range(45) if k not in held_out]
    for shard in range(3):
        got = [int(text_of(d)[16:]) for _, d in stream(cfg, Split.TRAIN, shard, 3)[:20]]
        assert got == (train[shard::3] * 2)[:20]  # Endless: the next epoch follows.


def test_directories_and_globs_name_their_files_in_order(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "b.jsonl", ["b"] * 3)
    write_jsonl(tmp_path / "d" / "a.jsonl", ["a"] * 3)
    (tmp_path / "d" / "notes.txt").write_text("skipped: not .jsonl")
    cfg = JsonlFiles.default_config().set(paths=[str(tmp_path / "d"), str(tmp_path / "d" / "a*")], eval_fraction=0)
    texts = [text_of(d) for _, d in stream(cfg, Split.TRAIN)[:9]]
    assert texts == ["a"] * 3 + ["b"] * 3 + ["a"] * 3


def test_parquet_and_text_files(tmp_path):
    pq.write_table(pa.table({"body": [f"row {i}" for i in range(10)]}), tmp_path / "t.parquet", row_group_size=4)
    got = stream(ParquetFiles.default_config().set(paths=[str(tmp_path)], field="body", eval_fraction=0.5), Split.EVAL)
    assert [text_of(d) for _, d in got] == [f"row {i}" for i in (1, 3, 5, 7, 9)]
    assert [loc for loc, _ in got][:2] == [f"'{tmp_path / 't.parquet'}' row 1", f"'{tmp_path / 't.parquet'}' row 3"]
    (tmp_path / "x.txt").write_text("whole file\n\nis one document")
    (text,) = stream(TextFiles.default_config().set(paths=[str(tmp_path / "*.txt")], eval_fraction=0), Split.TRAIN)[:1]
    assert text_of(text[1]) == "whole file\n\nis one document"


def test_chat_records_become_masked_documents(tmp_path):
    path = tmp_path / "chat.jsonl"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path.write_text(json.dumps(record) + "\n")
    ((location, doc),) = stream(ChatFiles.default_config().set(paths=[str(path)], eval_fraction=0), Split.TRAIN)[:1]
    text = doc["tokens"].astype(np.uint8).tobytes().decode()
    weighted = bytes(b for b, w in zip(doc["tokens"].astype(np.uint8), doc["loss_mask"]) if w).decode()
    assert text == "<|user|>\nhi<|end|>\n<|assistant|>\nyo<|end|>\n" and weighted == "yo<|end|>"
    assert location == f"'{path}' line 1"


def test_a_streamed_train_shard_without_documents_is_an_error(tmp_path):
    cfg = JsonlFiles.default_config().set(paths=[write_jsonl(tmp_path / "a.jsonl", ["x y"] * 3)], eval_fraction=0)
    with pytest.raises(DataError, match="data shard 3 of 4 gets none of the 3 train documents"):
        stream(cfg, Split.TRAIN, 3, 4)


# -- Token files --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_is_cut_into_documents(tmp_path, dtype):
    ids = np.arange(1000) % 300
    path = tmp_path / "ids.bin"
    ids.astype(dtype).tofile(path)
    source = TokenFile.default_config().set(path=str(path), dtype=dtype, document_tokens=64).instantiate()
    assert source.num_documents() == 16
    np.testing.assert_array_equal(np.concatenate([source.document(i)["tokens"] for i in range(16)]), ids)
    assert isinstance(source._map(), np.memmap)


@pytest.mark.parametrize("size", [0, 3])
def test_token_file_of_a_bad_size(tmp_path, size):
    (tmp_path / "ids.bin").write_bytes(b"\0" * size)
    source = TokenFile.default_config().set(path=str(tmp_path / "ids.bin")).instantiate()
    with pytest.raises(DataError, match=r"\(input.source.path\) has \d bytes, not a positive multiple of 2"):
        source.check()


# -- Errors that name the config path ------------------------------------------------------


def test_a_missing_file_names_the_config_path(tmp_path):
    cfg = InputConfig(source=JsonlFiles.default_config().set(paths=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]))
    with pytest.raises(DataError, match=r"^input.source.paths\[0\]: '.*a.jsonl' does not exist"):
        cfg.check()
    with pytest.raises(DataError, match=r"^Token file '.*x.bin' \(input.source.path\) does not exist"):
        InputConfig(source=TokenFile.default_config().set(path=str(tmp_path / "x.bin"))).check()


def test_a_jsonl_line_without_the_field_names_the_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    cfg = InputConfig(source=JsonlFiles.default_config().set(paths=[str(path)], eval_fraction=0), batch_size=1, seq_len=8)
    with pytest.raises(DataError, match=rf"'{path}' line 2 has no field 'text'"):
        next(cfg.make_pipeline(Split.TRAIN))


def test_an_empty_file_is_an_error(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    cfg = InputConfig(source=JsonlFiles.default_config().set(paths=[str(tmp_path / "a.jsonl")]), batch_size=1)
    with pytest.raises(DataError, match="a.jsonl"):
        next(cfg.make_pipeline(Split.TRAIN))


def test_a_non_source_is_refused():
    cfg = InputConfig(source=axcore.Configurable.default_config())
    with pytest.raises(DataError, match="input.source builds Configurable, which is not a DataSource"):
        cfg.make_pipeline(Split.TRAIN)


def test_unknown_split():
    with pytest.raises(DataError, match="Unknown split 'test'"):
        InputConfig().make_pipeline("test")
