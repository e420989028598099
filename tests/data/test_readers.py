"""axcore.data.readers: paths as users give them, streamed documents, and one-line errors naming file and line."""

import json
import os

import pytest

from axcore.data import DataError
from axcore.data.readers import (
    exact_location,
    expand_paths,
    iter_chat_records,
    iter_text_documents,
    line_location,
    line_start_at,
    parquet_row_groups,
)


def _write(path, data: bytes | str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return str(path)


def _jsonl(path, records, field="text"):
    return _write(path, "".join(json.dumps({field: r} if isinstance(r, str) else r) + "\n" for r in records))


def test_expand_paths_files_directories_and_globs(tmp_path):
    a = _write(tmp_path / "d" / "b.jsonl", "x")
    b = _write(tmp_path / "d" / "a.jsonl", "x")
    c = _write(tmp_path / "d" / "sub" / "c.jsonl", "x")
    _write(tmp_path / "d" / "notes.txt", "x")
    _write(tmp_path / "d" / ".hidden.jsonl", "x")
    single = _write(tmp_path / "z.jsonl", "x")
    got = expand_paths([single, str(tmp_path / "d")], "paths", suffixes=(".jsonl",))
    assert got == [single, b, a, c]
    assert expand_paths([str(tmp_path / "d" / "*.jsonl")], "p") == [b, a]
    assert expand_paths([str(tmp_path / "**" / "c.jsonl")], "p") == [c]
    assert len(expand_paths([str(tmp_path / "d")], "p")) == 4  # No suffix filter: every visible file.


def test_expand_paths_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    f = _write(tmp_path / "c.txt", "x")
    assert expand_paths(["~/c.txt"], "p") == [f]


@pytest.mark.parametrize("entry", ["missing.jsonl", "nothing-*.jsonl", "emptydir"])
def test_expand_paths_names_the_entry_that_matches_nothing(tmp_path, entry):
    (tmp_path / "emptydir").mkdir()
    ok = _write(tmp_path / "ok.jsonl", "x")
    with pytest.raises(DataError, match=r"input\.source\.paths\[1\]") as info:
        expand_paths([ok, str(tmp_path / entry)], "input.source.paths", suffixes=(".jsonl",))
    assert "\n" not in str(info.value)


def test_text_file_is_one_document(tmp_path):
    f = _write(tmp_path / "a.txt", b"\xef\xbb\xbfh\xc3\xa9llo\nworld\n")
    assert list(iter_text_documents(f, "text", "ignored")) == [(f"'{f}'", "héllo\nworld\n")]


def test_jsonl_documents_and_locations(tmp_path):
    f = _write(tmp_path / "a.jsonl", '{"text": "one"}\n\n  \n{"text": "two", "id": 3}\n{"text": "th\\u00e9"}')
    assert list(iter_text_documents(f, "jsonl", "text")) == [
        (f"'{f}' line 1", "one"),
        (f"'{f}' line 4", "two"),
        (f"'{f}' line 5", "thé"),
    ]


def test_jsonl_byte_ranges_cut_at_line_starts_cover_every_document_once(tmp_path):
    texts = [f"document {i} " + "w" * (i % 7) for i in range(50)]
    f = _jsonl(tmp_path / "a.jsonl", texts)
    size = os.path.getsize(f)
    cuts = sorted({line_start_at(f, k) for k in range(0, size, 97)} | {size})
    for cut in cuts:  # Each cut is a line start: 0 or right after a newline.
        assert cut == 0 or open(f, "rb").read()[cut - 1 : cut] == b"\n"
    got = []
    for start, end in zip(cuts, cuts[1:]):
        got.extend(text for _, text in iter_text_documents(f, "jsonl", "text", byte_range=(start, end)))
    assert got == texts
    start = cuts[3]
    location, _ = next(iter_text_documents(f, "jsonl", "text", byte_range=(start, size)))
    assert location == f"'{f}' byte {start}"
    line = open(f, "rb").read()[:start].count(b"\n") + 1
    assert line_location(f, start) == f"'{f}' line {line}"
    assert exact_location(location) == f"'{f}' line {line}"
    assert exact_location(f"'{f}' line 3") == f"'{f}' line 3"


def test_error_in_a_byte_range_names_the_exact_line(tmp_path):
    f = _write(tmp_path / "a.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n{"txt": "d"}\n')
    start = line_start_at(f, 20)  # The start of line 3.
    with pytest.raises(DataError, match=rf"JSONL file '{f}' line 4 has no field 'text' \(it has: txt\)"):
        list(iter_text_documents(f, "jsonl", "text", byte_range=(start, os.path.getsize(f))))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "a"}\n{"body": "b"}\n', r"line 2 has no field 'text' \(it has: body\)"),
        ('{"text": "a"}\n{"text": 5}\n', r"line 2: field 'text' is a JSON number, not a string"),
        ('{"text": "a"}\n{"text": "a"\n', r"line 2 is not valid JSON"),
        ('["text"]\n', r"line 1 is a JSON array, not an object"),
        (b'{"text": "a"}\n{"text": "\xff"}\n', r"line 2 is not valid UTF-8"),
        ("", r"holds no documents"),
        ("\n\n", r"holds no documents"),
    ],
)
def test_bad_jsonl_is_one_line_naming_file_and_line(tmp_path, content, message):
    f = _write(tmp_path / "bad.jsonl", content)
    with pytest.raises(DataError, match=message) as info:
        list(iter_text_documents(f, "jsonl", "text"))
    assert f"'{f}'" in str(info.value) and "\n" not in str(info.value)


def test_bad_text_files(tmp_path):
    empty = _write(tmp_path / "e.txt", b"")
    with pytest.raises(DataError, match=rf"'{empty}' is empty"):
        list(iter_text_documents(empty, "text", "text"))
    binary = _write(tmp_path / "b.txt", b"ok\nok\n\xc3(\n")
    with pytest.raises(DataError, match=rf"'{binary}' line 3 is not valid UTF-8"):
        list(iter_text_documents(binary, "text", "text"))
    with pytest.raises(DataError, match=r"'.*missing.txt' does not exist"):
        list(iter_text_documents(str(tmp_path / "missing.txt"), "text", "text"))
    with pytest.raises(DataError, match=r"Unknown text format 'csv'"):
        list(iter_text_documents(binary, "csv", "text"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    f = _write(tmp_path / "locked.jsonl", '{"text": "a"}\n')
    os.chmod(f, 0)
    with pytest.raises(DataError, match=rf"'{f}' cannot be read: Permission denied"):
        list(iter_text_documents(f, "jsonl", "text"))


def test_parquet_column_rows_and_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}" for i in range(25)]
    f = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": list(range(25)), "text": texts}), f, row_group_size=10)
    assert [rows for rows, _ in parquet_row_groups(f, "text")] == [10, 10, 5]
    assert list(iter_text_documents(f, "parquet", "text")) == [(f"'{f}' row {i}", t) for i, t in enumerate(texts)]
    assert list(iter_text_documents(f, "parquet", "text", row_groups=[2])) == [
        (f"'{f}' row {i}", texts[i]) for i in range(20, 25)
    ]
    with pytest.raises(DataError, match=rf"'{f}' has no column 'body' \(it has: id, text\)"):
        list(iter_text_documents(f, "parquet", "body"))
    with pytest.raises(DataError, match=rf"'{f}' column 'id' holds int64, not strings"):
        list(iter_text_documents(f, "parquet", "id"))
    nulls = str(tmp_path / "n.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), nulls)
    with pytest.raises(DataError, match=rf"'{nulls}' row 1: column 'text' is null"):
        list(iter_text_documents(nulls, "parquet", "text"))
    not_parquet = _write(tmp_path / "x.parquet", "hello")
    with pytest.raises(DataError, match=rf"Parquet file '{not_parquet}' cannot be read"):
        list(iter_text_documents(not_parquet, "parquet", "text"))


def test_chat_records(tmp_path):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "name": "bot"}]
    f = _jsonl(tmp_path / "c.jsonl", [{"messages": conversation}, {"messages": conversation[:1]}])
    assert list(iter_chat_records(f)) == [(f"'{f}' line 1", conversation), (f"'{f}' line 2", conversation[:1])]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"conversation": []}, r"has no field 'messages'"),
        ({"messages": []}, r"field 'messages' is an empty list"),
        ({"messages": "hi"}, r"field 'messages' is a JSON string"),
        ({"messages": ["hi"]}, r"messages\[0\] is a JSON string"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]\.content is missing"),
        ({"messages": [{"role": 1, "content": "x"}]}, r"messages\[0\]\.role is a JSON number"),
    ],
)
def test_bad_chat_records_name_file_and_line(tmp_path, record, message):
    good = {"messages": [{"role": "user", "content": "hi"}]}
    f = _jsonl(tmp_path / "c.jsonl", [good, record])
    with pytest.raises(DataError, match=rf"JSONL file '{f}' line 2.*{message}"):
        list(iter_chat_records(f))
