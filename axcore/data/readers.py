"""File readers: corpus paths as users give them, and documents streamed out of text, JSONL and Parquet files.

Everything that reads a user's corpus goes through here (`axcore prepare`, the streamed
sources, chat data), so paths, formats and errors behave the same everywhere:

- `expand_paths` turns a list of files, directories and globs into files;
- `iter_text_documents` yields `(location, text)` for every document of a file:
  `text` (the whole file is one document), `jsonl` (the string in `field` of each
  line's object) or `parquet` (the string column `field`);
- `iter_chat_records` yields `(location, messages)` for chat JSONL files.

JSONL and Parquet files are streamed (line by line, record batch by record batch),
never read whole. A `location` names the file and the line (`"'/x/a.jsonl' line 17"`)
or row (`"'/x/a.parquet' row 123"`) so later errors can point at the document. Bad
input raises `DataError` with a one-line message naming the file and line or row.

Work splitting (`axcore prepare`): a JSONL file can be read in byte ranges that start
at line starts (`line_start_at` finds one) and a Parquet file by row groups
(`parquet_row_groups`). Inside a byte range that does not start at 0 the line number
is not known without reading the file from its start, so the yielded locations say
`"'/x/a.jsonl' byte 123456"` instead; the readers' own errors always give the exact
line (counted only when an error happens), and `line_location` turns a byte offset
into it.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from axcore.data.errors import DataError
from axcore.errors import one_line

# Formats `iter_text_documents` reads.
TEXT_FORMATS = ("text", "jsonl", "parquet")
# Rows per Parquet record batch (bounds the memory of one read).
_PARQUET_BATCH_ROWS = 4096
# Bytes read per step when counting lines or looking for a line start.
_SCAN_BYTES = 1 << 20
_GLOB_CHARS = frozenset("*?[")


def expand_paths(paths: Sequence[str], field: str, *, suffixes: tuple[str, ...] = ()) -> list[str]:
    """The files named by `paths`: each entry a file, a directory or a glob (`*`, `?`, `[...]`, `**`).

    A leading `~` is expanded. A directory stands for every file below it (recursively,
    hidden names starting with "." skipped) whose name ends with one of `suffixes` (all
    files when `suffixes` is empty); a glob for the files it matches (a matched
    directory is expanded the same way). Files are sorted within each entry and the
    entries keep their order.

    Raises:
        DataError: naming `f"{field}[{i}]"` when entry i matches no file.
    """
    files: list[str] = []
    for index, entry in enumerate(paths):
        where = f"{field}[{index}]"
        if not isinstance(entry, str) or not entry:
            raise DataError(f"{where} is {entry!r}; give a file, a directory or a glob such as 'data/*.jsonl'.")
        path = os.path.expanduser(entry)
        if _GLOB_CHARS & set(path):
            found: list[str] = []
            for match in sorted(glob.glob(path, recursive=True)):
                found.extend(_directory_files(match, suffixes) if os.path.isdir(match) else [match])
            if not found:
                raise DataError(f"{where}: glob '{entry}' matches no file; fix the pattern or the directory.")
        elif os.path.isdir(path):
            found = _directory_files(path, suffixes)
            if not found:
                wanted = f" ending with {', '.join(suffixes)}" if suffixes else ""
                raise DataError(f"{where}: directory '{path}' holds no files{wanted}; fix the path or add files.")
        elif os.path.exists(path):
            found = [path]
        else:
            raise DataError(f"{where}: '{path}' does not exist; fix the path (a file, a directory or a glob).")
        files.extend(sorted(found))
    return files


def _directory_files(directory: str, suffixes: tuple[str, ...]) -> list[str]:
    """Files below `directory` whose names end with one of `suffixes` (any if empty), hidden names skipped."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if not name.startswith(".") and (not suffixes or name.endswith(suffixes)):
                found.append(os.path.join(root, name))
    return sorted(found)


def _format_name(format: Any) -> str:
    """A format given as a string or an enum member (its value) -> its name."""
    name = getattr(format, "value", format)
    if name not in TEXT_FORMATS:
        raise DataError(f"Unknown text format {name!r}; use one of {', '.join(TEXT_FORMATS)}.")
    return name


def iter_text_documents(
    path: str,
    format: str,
    field: str,
    *,
    byte_range: tuple[int, int] | None = None,
    row_groups: Sequence[int] | None = None,
) -> Iterator[tuple[str, str]]:
    """Yields `(location, text)` for each document of the file at `path`, in file order.

    `format`: "text" (the whole file, a leading UTF-8 BOM dropped, is one document),
    "jsonl" (the string `field` of each line's JSON object; blank lines skipped) or
    "parquet" (the string column `field`). `byte_range=(start, end)` (JSONL only) reads
    the lines that start in `[start, end)`; `start` must be a line start. `row_groups`
    (Parquet only) reads just those row groups. Without either, a file without any
    document is an error.

    Raises:
        DataError: naming the file and line or row: unreadable or missing file, empty
            file, invalid UTF-8, a line that is not a JSON object, a missing field, a
            value that is not a string, not a Parquet file, a missing column.
    """
    name = _format_name(format)
    if byte_range is not None and name != "jsonl":
        raise DataError(f"'{path}': byte ranges are only read from JSONL files, not {name}.")
    if row_groups is not None and name != "parquet":
        raise DataError(f"'{path}': row groups are only read from Parquet files, not {name}.")
    if name == "text":
        yield f"'{path}'", _read_text_file(path)
    elif name == "jsonl":
        for location, record, line_at in _iter_jsonl_objects(path, byte_range):
            value = _required(record, field, location, line_at, "the field that holds the text")
            if not isinstance(value, str):
                raise DataError(
                    f"{line_at()}: field '{field}' is a JSON {_json_type(value)}, not a string; "
                    f"name the field that holds the text."
                )
            yield location, value
    else:
        yield from _iter_parquet_strings(path, field, row_groups)


def iter_chat_records(
    path: str, field: str = "messages", *, byte_range: tuple[int, int] | None = None
) -> Iterator[tuple[str, list[dict]]]:
    """Yields `(location, messages)` for each line of a chat JSONL file.

    Each line is a JSON object whose `field` is a non-empty list of messages, each an
    object with string "role" and "content" (other keys are passed through; roles are
    checked by the chat renderer, not here). `byte_range` as in `iter_text_documents`.

    Raises:
        DataError: naming the file and line for a malformed record (and as
            `iter_text_documents` for unreadable files).
    """
    for location, record, line_at in _iter_jsonl_objects(path, byte_range):
        messages = _required(record, field, location, line_at, "the field that holds the messages")
        if not isinstance(messages, list) or not messages:
            what = "an empty list" if messages == [] else f"a JSON {_json_type(messages)}"
            raise DataError(
                f"{line_at()}: field '{field}' is {what}; it must be a non-empty list of "
                f'{{"role": ..., "content": ...}} messages.'
            )
        for number, message in enumerate(messages):
            if not isinstance(message, dict):
                raise DataError(
                    f"{line_at()}: {field}[{number}] is a JSON {_json_type(message)}; "
                    f'each message must be an object {{"role": ..., "content": ...}}.'
                )
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    got = "missing" if key not in message else f"a JSON {_json_type(message[key])}"
                    raise DataError(f"{line_at()}: {field}[{number}].{key} is {got}; it must be a string.")
        yield location, messages


def line_location(path: str, offset: int) -> str:
    """`"'path' line N"` for the line holding byte `offset` (counts the newlines before it)."""
    newlines = 0
    with open(path, "rb") as f:
        remaining = offset
        while remaining > 0:
            chunk = f.read(min(_SCAN_BYTES, remaining))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            remaining -= len(chunk)
    return f"'{path}' line {newlines + 1}"


def exact_location(location: str) -> str:
    """A location with a byte offset (`"'/x/a.jsonl' byte 123"`, from a byte range) as its line; others unchanged."""
    head, sep, offset = location.rpartition(" byte ")
    if not sep or not offset.isdigit() or not (head.startswith("'") and head.endswith("'")):
        return location
    return line_location(head[1:-1], int(offset))


def line_start_at(path: str, offset: int) -> int:
    """The first line start at or after byte `offset` (the file size when there is none).

    A line start is offset 0 or the byte after a newline. `axcore prepare` cuts JSONL
    files here, so its work units depend on the file alone.
    """
    if offset <= 0:
        return 0
    with _open(path) as f:
        f.seek(offset - 1)
        position = offset - 1
        while True:
            chunk = f.read(_SCAN_BYTES)
            if not chunk:
                return position
            found = chunk.find(b"\n")
            if found >= 0:
                return position + found + 1
            position += len(chunk)


def parquet_row_groups(path: str, field: str) -> list[tuple[int, int]]:
    """`(rows, uncompressed bytes)` of each row group of a Parquet file, read from its footer only.

    Raises:
        DataError: the file is not Parquet or has no string column `field`.
    """
    metadata = _parquet_file(path, field).metadata
    return [(metadata.row_group(i).num_rows, metadata.row_group(i).total_byte_size) for i in range(metadata.num_row_groups)]


def _open(path: str):
    """`open(path, "rb")` with one-line errors."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"Data file '{path}' does not exist; fix the path or create the file.") from None
    except IsADirectoryError:
        raise DataError(f"Data file '{path}' is a directory; name the files (or a glob) instead.") from None
    except OSError as e:
        raise DataError(f"Data file '{path}' cannot be read: {e.strerror or e}; fix its permissions or the path.") from None


def _read_text_file(path: str) -> str:
    with _open(path) as f:
        try:
            raw = f.read()
        except OSError as e:
            raise DataError(f"Data file '{path}' cannot be read: {e.strerror or e}.") from None
    raw = raw.removeprefix(codecs.BOM_UTF8)
    if not raw:
        raise DataError(f"Text file '{path}' is empty; fill it or remove it from the inputs.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"Text file '{path}' line {line} is not valid UTF-8 (byte {e.start}); convert the file to UTF-8."
        ) from None


def _iter_jsonl_objects(path: str, byte_range: tuple[int, int] | None):
    """Yields `(location, record dict, line_at)` per non-blank line; `line_at()` is the exact "JSONL file ... line N"."""
    start, end = byte_range if byte_range is not None else (0, None)
    with _open(path) as f:
        if start:
            f.seek(start)
        position = start
        relative = 0  # Line index within the range.
        base_line: list[int] = []  # Line number at `start`, counted once, on the first error.
        found = False

        def exact_line(index: int) -> int:
            if not base_line:
                base_line.append(int(line_location(path, start).rsplit(" ", 1)[1]) if start else 1)
            return base_line[0] + index

        try:
            for raw in f:
                if end is not None and position >= end:
                    break
                line_offset = position
                position += len(raw)
                index = relative
                relative += 1
                if line_offset == 0:
                    raw = raw.removeprefix(codecs.BOM_UTF8)
                if not raw.strip():
                    continue

                def line_at(index=index) -> str:
                    return f"JSONL file '{path}' line {exact_line(index)}"

                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{line_at()} is not valid UTF-8 (column {e.start + 1}); convert the file to UTF-8.") from None
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{line_at()} is not valid JSON ({e.msg}, column {e.colno}); each line must be one JSON object."
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(f"{line_at()} is a JSON {_json_type(record)}, not an object; write one object per line.")
                found = True
                if byte_range is None or start == 0:
                    location = f"'{path}' line {index + 1}"
                else:
                    location = f"'{path}' byte {line_offset}"
                yield location, record, line_at
        except OSError as e:
            raise DataError(f"Data file '{path}' cannot be read: {e.strerror or e}.") from None
    if not found and byte_range is None:
        raise DataError(f"JSONL file '{path}' holds no documents (it is empty); fill it or remove it from the inputs.")


def _required(record: dict, field: str, location: str, line_at, what: str) -> Any:
    if field not in record:
        keys = ", ".join(map(str, record)) or "none"
        raise DataError(f"{line_at()} has no field '{field}' (it has: {keys}); name {what} (the field option).")
    return record[field]


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _parquet_file(path: str, field: str):
    """An open `pyarrow.parquet.ParquetFile` whose schema has a string column `field`."""
    import pyarrow as pa  # Imported when a Parquet file is read, not with axcore.data.
    import pyarrow.parquet as pq

    with _open(path):  # One-line errors for missing / unreadable files.
        pass
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"Parquet file '{path}' cannot be read ({one_line(e)}); is it a Parquet file?") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise DataError(
            f"Parquet file '{path}' has no column '{field}' (it has: {', '.join(schema.names)}); "
            f"name the column that holds the text (the field option)."
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise DataError(f"Parquet file '{path}' column '{field}' holds {kind}, not strings; name a text column.")
    return parquet


def _iter_parquet_strings(path: str, field: str, row_groups: Sequence[int] | None) -> Iterator[tuple[str, str]]:
    import pyarrow as pa

    parquet = _parquet_file(path, field)
    metadata = parquet.metadata
    groups = list(range(metadata.num_row_groups)) if row_groups is None else list(row_groups)
    first_rows = [0]
    for i in range(metadata.num_row_groups):
        first_rows.append(first_rows[-1] + metadata.row_group(i).num_rows)
    if row_groups is None and first_rows[-1] == 0:
        raise DataError(f"Parquet file '{path}' holds no rows; fill it or remove it from the inputs.")
    for group in groups:
        row = first_rows[group]
        try:
            batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group], columns=[field])
            for batch in batches:
                for value in batch.column(0).to_pylist():
                    if value is None:
                        raise DataError(f"Parquet file '{path}' row {row}: column '{field}' is null; drop or fill the row.")
                    yield f"'{path}' row {row}", value
                    row += 1
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"Parquet file '{path}' cannot be read near row {row}: {one_line(e)}.") from None
