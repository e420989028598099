"""Data sources: text, JSONL and token files; train/eval splits; errors that name the file."""

import json
import re

import numpy as np
import pytest

import axcore
from axcore.config import from_dict, to_dict
from axcore.data import (
    DOCUMENT_SEPARATOR,
    DataError,
    DataSource,
    EmbeddedCorpus,
    InputConfig,
    Split,
    TextFiles,
    TextFormat,
    TokenDtype,
    TokenFile,
)
from axcore.errors import AxcoreError, MissingRequiredError


def text_files(paths, **kwargs):
    return TextFiles.default_config().set(paths=[str(p) for p in paths], **kwargs).instantiate()


def write_jsonl(path, records, field="text"):
    path.write_text("".join(json.dumps({field: r, "id": i}) + "\n" for i, r in enumerate(records)), encoding="utf-8")
    return path


def test_data_error_is_an_axcore_error():
    assert issubclass(DataError, AxcoreError)


def test_sources_are_registered():
    regs = axcore.create_plugin_manager().registries
    assert regs.data_sources.names() == ["embedded_corpus", "text_files", "token_file"]
    assert regs.lookup("text_files") is TextFiles
    assert regs.data_sources.entry("token_file").provenance.distribution == "axcore"
    for name in regs.data_sources:
        assert issubclass(regs.data_sources[name], DataSource)


def test_input_config_round_trips_through_registered_names(registries):
    cfg = InputConfig(batch_size=4)
    data = to_dict(cfg, registries)
    assert data["source"] == {"type": "embedded_corpus", "eval_fraction": 0.05}
    assert from_dict(data, registries, InputConfig()) == cfg
    other = from_dict(
        {"source": {"type": "token_file", "path": "/x.bin", "dtype": "uint32"}}, registries, InputConfig()
    )
    assert other.source.klass is TokenFile and other.source.dtype is TokenDtype.UINT32


def test_every_config_field_is_documented():
    import inspect

    for cls in (DataSource, EmbeddedCorpus, TextFiles, TokenFile):
        source = inspect.getsource(cls.Config)
        lines = source.splitlines()
        for i, line in enumerate(lines):
            if ":" in line and "=" in line and not line.strip().startswith(("#", '"')):
                assert lines[i - 1].strip().startswith("#"), f"{cls.__name__}: {line.strip()} lacks a comment"


# -- Text files ---------------------------------------------------------------------------


def test_text_files_join_documents_and_split_the_stream(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("First document. " * 40, encoding="utf-8")
    b.write_text("Zweites Dokument: Grüße! " * 40, encoding="utf-8")
    source = text_files([a, b], eval_fraction=0.1)
    stream = a.read_bytes() + DOCUMENT_SEPARATOR + b.read_bytes()
    train, eval_ = source.tokens(Split.TRAIN), source.tokens(Split.EVAL)
    # Two documents are too few to split by count (round(0.2) == 0): split the stream.
    assert len(eval_) == round(len(stream) * 0.1)
    assert len(train) + len(eval_) == len(stream)
    assert train.tobytes() + eval_.tobytes() == stream
    assert source.tokens("train") is train  # Cached; splits by value work too.


def test_text_files_split_by_documents(tmp_path):
    paths = []
    for i in range(10):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(f"document number {i}\n", encoding="utf-8")
    source = text_files(paths, eval_fraction=0.2)
    docs = [p.read_bytes() for p in paths]
    assert source.tokens(Split.TRAIN).tobytes() == DOCUMENT_SEPARATOR.join(docs[:8])
    assert source.tokens(Split.EVAL).tobytes() == DOCUMENT_SEPARATOR.join(docs[8:])


def test_jsonl_documents_split_by_count(tmp_path):
    records = [f"record {i}: naïve café" for i in range(20)]
    path = write_jsonl(tmp_path / "docs.jsonl", records)
    source = text_files([path], format="jsonl", eval_fraction=0.25)
    assert source.config.format is TextFormat.JSONL
    train = source.tokens(Split.TRAIN).tobytes().decode("utf-8")
    eval_ = source.tokens(Split.EVAL).tobytes().decode("utf-8")
    assert train.split("\n\n") == records[:15]
    assert eval_.split("\n\n") == records[15:]
    assert not set(train.split("\n\n")) & set(eval_.split("\n\n"))


def test_jsonl_custom_field_and_blank_lines(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"body": "one"}\n\n{"body": "two"}\n', encoding="utf-8")
    source = text_files([path], format="jsonl", jsonl_field="body", eval_fraction=0.5)
    assert source.tokens(Split.TRAIN).tobytes() == b"one"
    assert source.tokens(Split.EVAL).tobytes() == b"two"


def test_zero_eval_fraction_keeps_everything_for_training(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("all of it", encoding="utf-8")
    source = text_files([path], eval_fraction=0.0)
    assert source.tokens(Split.TRAIN).tobytes() == b"all of it"
    with pytest.raises(DataError, match="eval split is empty.*eval_fraction > 0"):
        source.tokens(Split.EVAL)


# -- Token files --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_is_memory_mapped_and_split(tmp_path, dtype):
    ids = (np.arange(1000, dtype=np.int64) * 7919 % (60000 if dtype == "uint16" else 3_000_000)).astype(dtype)
    path = tmp_path / f"tokens.{dtype}.bin"
    ids.tofile(path)
    source = TokenFile.default_config().set(path=str(path), dtype=dtype, eval_fraction=0.1).instantiate()
    train, eval_ = source.tokens(Split.TRAIN), source.tokens(Split.EVAL)
    assert isinstance(train, np.memmap) and isinstance(eval_, np.memmap)  # Views, not copies.
    assert train.dtype == np.dtype(dtype)
    assert len(train) == 900 and len(eval_) == 100
    np.testing.assert_array_equal(train, ids[:900])
    np.testing.assert_array_equal(eval_, ids[900:])


# -- Errors -------------------------------------------------------------------------------


def test_missing_text_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=rf"'{re.escape(str(missing))}'.*does not exist"):
        text_files([missing]).tokens(Split.TRAIN)


def test_empty_text_file(tmp_path):
    good, empty = tmp_path / "good.txt", tmp_path / "empty.txt"
    good.write_text("text", encoding="utf-8")
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=rf"'{re.escape(str(empty))}' is empty"):
        text_files([good, empty]).tokens(Split.TRAIN)


def test_text_file_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=rf"'{re.escape(str(path))}' line 2 is not valid UTF-8"):
        text_files([path]).tokens(Split.TRAIN)


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (['{"text": "ok"}', '{"text": "broken'], r"line 2 is not valid JSON"),
        (['{"text": "ok"}', "", "[1, 2]"], r"line 3 is a JSON list, not an object"),
        (['{"txt": "hi"}'], r"line 1 has no field 'text' \(it has: txt\).*jsonl_field"),
        (['{"text": 3}'], r"line 1: field 'text' is a JSON int, not a string"),
        (["", "  "], r"holds no documents"),
    ],
)
def test_bad_jsonl(tmp_path, lines, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"'{re.escape(str(path))}'.*{pattern}"):
        text_files([path], format="jsonl").tokens(Split.TRAIN)


def test_empty_path_list():
    with pytest.raises(DataError, match="paths is empty"):
        TextFiles.default_config().set(paths=[]).instantiate().tokens(Split.TRAIN)


def test_required_fields():
    with pytest.raises(MissingRequiredError, match="paths"):
        TextFiles.default_config().instantiate()
    with pytest.raises(MissingRequiredError, match="path"):
        TokenFile.default_config().instantiate()


def test_bad_eval_fraction(tmp_path):
    with pytest.raises(DataError, match=r"eval_fraction must be in \[0, 1\)"):
        EmbeddedCorpus.default_config().set(eval_fraction=1.0).instantiate()


def test_split_too_small(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("ab", encoding="utf-8")
    with pytest.raises(DataError, match=rf"'{re.escape(str(path))}'.*eval split is empty"):
        text_files([path], eval_fraction=0.1).tokens(Split.EVAL)


def token_file(path, dtype="uint16"):
    return TokenFile.default_config().set(path=str(path), dtype=dtype).instantiate()


def test_missing_token_file(tmp_path):
    with pytest.raises(DataError, match=rf"'{re.escape(str(tmp_path / 'x.bin'))}'.*does not exist"):
        token_file(tmp_path / "x.bin").tokens(Split.TRAIN)
    with pytest.raises(DataError, match=rf"'{re.escape(str(tmp_path))}'.*is not a file"):
        token_file(tmp_path).tokens(Split.TRAIN)


def test_empty_token_file(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(DataError, match=rf"'{re.escape(str(path))}' is empty"):
        token_file(path).tokens(Split.TRAIN)


@pytest.mark.parametrize(("size", "dtype"), [(7, "uint16"), (10, "uint32")])
def test_token_file_size_not_a_multiple_of_dtype(tmp_path, size, dtype):
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(size))
    pattern = rf"'{re.escape(str(path))}' has {size} bytes, not a multiple of .*\({dtype}\).*TokenFile.dtype"
    with pytest.raises(DataError, match=pattern):
        token_file(path, dtype).tokens(Split.TRAIN)


def test_unknown_split():
    with pytest.raises(DataError, match="Unknown split 'test'"):
        EmbeddedCorpus.default_config().instantiate().tokens("test")
