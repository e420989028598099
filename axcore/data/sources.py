"""Data sources: configurable producers of a 1-D token stream per split.

Every source holds out the *last* `eval_fraction` of its data for evaluation, so the
train and eval splits never overlap:

- a single-stream source (`TokenFile`, and any source whose documents are too few to
  split, see below) cuts its token stream: of `n` tokens, the last
  `round(n * eval_fraction)` are the eval split and the rest the train split;
- a multi-document source (`TextFiles`, `EmbeddedCorpus`) cuts its list of
  documents: of `d` documents the last `round(d * eval_fraction)` are the eval
  split. When that would leave either side without a document (for example one big
  text file), it falls back to cutting the joined token stream as above.

Documents are joined with `DOCUMENT_SEPARATOR` (a blank line, `b"\\n\\n"`) and
tokenized with the experiment's tokenizer (`use_tokenizer`; by default, and with the
`bytes` tokenizer, token id = UTF-8 byte, as a zero-copy view). Within one split, the
separator goes between documents only. Other tokenizers encode document by document
(`Tokenizer.encode_documents`, which may batch and mark document starts and ends),
each document but the last of a split followed by the separator, and the ids are
concatenated; so a big corpus is never one string, and a tokenizer whose ids do not
depend on where the text is cut gives exactly the ids of the joined text.
Pre-tokenized sources (`TokenFile`) ignore the tokenizer.
"""

from __future__ import annotations

from typing import Annotated
import codecs
import enum
import importlib.resources
import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from axcore.config import REQUIRED, Configurable, Probability
from axcore.data.errors import DataError
from axcore.data.tokenizer import ByteTokenizer, Tokenizer

# Bytes put between two documents of one split (a blank line).
DOCUMENT_SEPARATOR = b"\n\n"

# The shipped novels (see `axcore/data/corpus/SOURCE.md`), in reading order.
CORPUS_FILES = (
    "sense_and_sensibility.txt",
    "pride_and_prejudice.txt",
    "northanger_abbey.txt",
    "persuasion.txt",
)


class Split(enum.Enum):
    """Which part of a source's data to read."""

    TRAIN = "train"
    EVAL = "eval"


def as_split(split: Split | str) -> Split:
    """`Split` from a member or its value (`"train"`, `"eval"`)."""
    try:
        return Split(split)
    except ValueError:
        raise DataError(f"Unknown split {split!r}; use one of {[s.value for s in Split]}.") from None


class DataSource(Configurable):
    """Base of data sources. Subclasses implement `tokens(split)`.

    `tokens(split)` returns a 1-D integer array (possibly a read-only `np.memmap`
    or view) holding that split's whole token stream; callers index into it and must
    not modify it.
    """

    class Config(Configurable.Config):
        """Configures DataSource."""

        # Share held out for eval: the last tokens (or documents); 0 means no eval split.
        eval_fraction: Annotated[float, Probability] = 0.05

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        fraction = cfg.eval_fraction
        if not 0.0 <= fraction < 1.0:
            raise DataError(
                f"{type(self).__name__}.eval_fraction must be in [0, 1), got {fraction}; "
                f"e.g. 0.05 holds out the last 5% for eval."
            )
        self._cache: dict[Split, np.ndarray] = {}
        self._tokenizer: Tokenizer | None = None

    def use_tokenizer(self, tokenizer: Tokenizer | None) -> None:
        """Tokenize text with `tokenizer` (None: bytes); call before the first `tokens()`."""
        if self._cache:
            raise DataError(f"{type(self).__name__}: set the tokenizer before reading tokens.")
        self._tokenizer = tokenizer

    def encode(self, text: bytes) -> np.ndarray:
        """UTF-8 `text` -> token ids `[n]` with this source's tokenizer (bytes: a read-only uint8 view)."""
        if self._tokenizer is None or isinstance(self._tokenizer, ByteTokenizer):
            return _byte_tokens(text)
        return np.asarray(self._tokenizer.encode(text.decode("utf-8")))

    def encode_documents(self, documents: Sequence[bytes]) -> np.ndarray:
        """UTF-8 `documents` -> the token ids `[n]` of the split they make (module docstring).

        Bytes: the joined text as a read-only uint8 view. Another tokenizer: its
        `encode_documents` of each document (all but the last followed by
        `DOCUMENT_SEPARATOR`), concatenated as int32.
        """
        if self._tokenizer is None or isinstance(self._tokenizer, ByteTokenizer):
            return _byte_tokens(DOCUMENT_SEPARATOR.join(documents))
        last = len(documents) - 1
        texts = [(d + DOCUMENT_SEPARATOR if i < last else d).decode("utf-8") for i, d in enumerate(documents)]
        ids = self._tokenizer.encode_documents(texts)
        if len(ids) != len(texts):
            raise DataError(
                f"{type(self._tokenizer).__name__}.encode_documents returned {len(ids)} arrays for {len(texts)} "
                f"documents; it must return one per document."
            )
        return np.concatenate([np.asarray(x, np.int32).reshape(-1) for x in ids]) if ids else np.zeros((0,), np.int32)

    def tokens(self, split: Split) -> np.ndarray:
        """The token stream of `split`: 1-D integer array `[num_tokens]`, never empty.

        Raises:
            DataError: when the data cannot be read or the split is empty.
        """
        split = as_split(split)
        if split not in self._cache:
            self._cache[split] = self._load(split)
        return self._cache[split]

    def _load(self, split: Split) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} must implement _load(split).")


def split_stream(tokens: np.ndarray, eval_fraction: float, split: Split, where: str) -> np.ndarray:
    """The train (head) or eval (tail) part of one stream; a view, never a copy.

    Raises:
        DataError: naming `where` if the part is empty.
    """
    num = len(tokens)
    cut = num - int(round(num * eval_fraction))
    part = tokens[:cut] if split is Split.TRAIN else tokens[cut:]
    if len(part) == 0:
        if split is Split.EVAL:
            hint = "set eval_fraction > 0" if eval_fraction == 0 else "add data or raise eval_fraction"
        else:
            hint = "add data or lower eval_fraction"
        raise DataError(
            f"{where}: the {split.value} split is empty ({num} tokens in all, "
            f"eval_fraction={eval_fraction}); {hint}."
        )
    return part


def split_documents(
    documents: Sequence[bytes],
    eval_fraction: float,
    split: Split,
    where: str,
    encode: Callable[[bytes], np.ndarray] | None = None,
    *,
    encode_documents: Callable[[Sequence[bytes]], np.ndarray] | None = None,
) -> np.ndarray:
    """Tokens of the train (leading) or eval (trailing) documents, joined.

    Tokenized by `encode_documents` (documents -> the joined stream, e.g.
    `DataSource.encode_documents`) if given, else by `encode` (default bytes) of the
    documents joined with `DOCUMENT_SEPARATOR`. Falls back to `split_stream` over all
    documents when splitting by document count would leave either side without a document.
    """
    if encode_documents is None:
        encode = encode or _byte_tokens

        def encode_documents(docs: Sequence[bytes]) -> np.ndarray:
            return encode(DOCUMENT_SEPARATOR.join(docs))

    num_eval = int(round(len(documents) * eval_fraction))
    if not 0 < num_eval < len(documents):
        return split_stream(encode_documents(documents), eval_fraction, split, where)
    cut = len(documents) - num_eval
    part = documents[:cut] if split is Split.TRAIN else documents[cut:]
    tokens = encode_documents(part)
    if len(tokens) == 0:
        raise DataError(f"{where}: the {split.value} split holds only empty documents; add text.")
    return tokens


def _byte_tokens(data: bytes) -> np.ndarray:
    """Read-only uint8 view of `data` (token id = byte, as `ByteTokenizer.encode`)."""
    return np.frombuffer(data, dtype=np.uint8)


class EmbeddedCorpus(DataSource):
    """The English prose shipped inside axcore (four Jane Austen novels, about 2.3 MB).

    Each novel is one document (see `CORPUS_FILES`); with the default
    `eval_fraction` the documents are too few to split by count, so the eval split is
    the last 5% of the bytes (the end of Persuasion). Read through
    `importlib.resources`; nothing is downloaded.
    """

    class Config(DataSource.Config):
        """Configures EmbeddedCorpus."""

    def _load(self, split: Split) -> np.ndarray:
        return split_documents(
            read_corpus_documents(), self._config.eval_fraction, split, "embedded corpus", encode_documents=self.encode_documents
        )


def read_corpus_documents() -> list[bytes]:
    """The raw UTF-8 bytes of each shipped novel, in `CORPUS_FILES` order."""
    root = importlib.resources.files("axcore.data").joinpath("corpus")
    documents = []
    for name in CORPUS_FILES:
        try:
            documents.append(root.joinpath(name).read_bytes())
        except OSError as e:
            raise DataError(
                f"Embedded corpus file 'axcore/data/corpus/{name}' cannot be read ({e.strerror or e}); "
                f"reinstall axcore so that its package data is present."
            ) from None
    return documents


class TextFormat(enum.Enum):
    """How `TextFiles` reads a file."""

    # The whole file is one document.
    TEXT = "text"
    # One JSON object per line; each is a document (blank lines are skipped).
    JSONL = "jsonl"


class TextFiles(DataSource):
    """UTF-8 text or JSONL files, tokenized with the experiment's tokenizer; documents joined by a blank line.

    A `text` file is one document; each line of a `jsonl` file is one document,
    the string in its `jsonl_field`. Eval is the trailing documents (see the module
    docstring).
    """

    class Config(DataSource.Config):
        """Configures TextFiles."""

        # Files to read, in this order (a leading ~ is expanded).
        paths: list[str] = REQUIRED
        # File format: "text" (a file is a document) or "jsonl" (a line is a document).
        format: TextFormat = TextFormat.TEXT
        # The JSONL field that holds each document's text.
        jsonl_field: str = "text"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._documents: list[bytes] | None = None

    def _load(self, split: Split) -> np.ndarray:
        cfg = self._config
        if not cfg.paths:
            raise DataError("TextFiles.paths is empty; list at least one file to read.")
        if self._documents is None:  # Read once for both splits.
            self._documents = self._read_documents()
        where = "TextFiles " + ", ".join(f"'{p}'" for p in cfg.paths[:3])
        if len(cfg.paths) > 3:
            where += f" and {len(cfg.paths) - 3} more"
        return split_documents(self._documents, cfg.eval_fraction, split, where, encode_documents=self.encode_documents)

    def _read_documents(self) -> list[bytes]:
        cfg = self._config
        documents: list[bytes] = []
        for index, path in enumerate(cfg.paths):
            raw = _read_file(os.path.expanduser(path), f"TextFiles.paths[{index}]")
            if cfg.format is TextFormat.TEXT:
                documents.append(_text_document(raw, path))
            else:
                documents.extend(_jsonl_documents(raw, path, cfg.jsonl_field))
        return documents


def _read_file(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"Data file '{path}' ({field}) does not exist; fix the path or create the file.") from None
    except OSError as e:
        raise DataError(f"Data file '{path}' ({field}) cannot be read: {e.strerror or e}; fix the path.") from None


def _decode_utf8(raw: bytes, path: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"Data file '{path}' line {line} is not valid UTF-8 (byte offset {e.start}); "
            f"convert the file to UTF-8."
        ) from None


def _text_document(raw: bytes, path: str) -> bytes:
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    _decode_utf8(raw, path)
    if not raw:
        raise DataError(f"Text file '{path}' is empty; fill it or remove it from TextFiles.paths.")
    return raw


def _jsonl_documents(raw: bytes, path: str, field: str) -> list[bytes]:
    text = _decode_utf8(raw, path).removeprefix("\ufeff")
    documents = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"JSONL file '{path}' line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where} is not valid JSON ({e.msg}, column {e.colno}); each line must be one JSON object."
            ) from None
        if not isinstance(record, dict):
            raise DataError(f"{where} is a JSON {type(record).__name__}, not an object; write one object per line.")
        if field not in record:
            raise DataError(
                f"{where} has no field '{field}' (it has: {', '.join(map(str, record)) or 'none'}); "
                f"set TextFiles.jsonl_field to the field that holds the text."
            )
        value = record[field]
        if not isinstance(value, str):
            raise DataError(
                f"{where}: field '{field}' is a JSON {type(value).__name__}, not a string; "
                f"set TextFiles.jsonl_field to the field that holds the text."
            )
        try:
            documents.append(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise DataError(f"{where}: field '{field}' holds an unpaired surrogate escape; fix the text.") from None
    if not documents:
        raise DataError(f"JSONL file '{path}' holds no documents; fill it or remove it from TextFiles.paths.")
    return documents


class TokenDtype(enum.Enum):
    """Element type of a `TokenFile` (little-endian unsigned integers)."""

    UINT16 = "uint16"
    UINT32 = "uint32"


class TokenFile(DataSource):
    """Pre-tokenized ids in a raw binary file, read with `np.memmap` (never loaded whole).

    The file is a headerless little-endian array, e.g. written with
    `np.asarray(ids, np.uint16).tofile(path)`. It is one stream; eval is its tail.
    """

    class Config(DataSource.Config):
        """Configures TokenFile."""

        # Path of the raw token file (a leading ~ is expanded).
        path: str = REQUIRED
        # Element type of the file: "uint16" (vocabularies up to 65,536) or "uint32".
        dtype: TokenDtype = TokenDtype.UINT16

    def _load(self, split: Split) -> np.ndarray:
        cfg = self._config
        path = os.path.expanduser(cfg.path)
        dtype = np.dtype(cfg.dtype.value).newbyteorder("<")
        if not os.path.isfile(path):
            what = "is not a file" if os.path.exists(path) else "does not exist"
            raise DataError(f"Token file '{path}' (TokenFile.path) {what}; fix the path.")
        size = os.path.getsize(path)
        if size == 0:
            raise DataError(f"Token file '{path}' is empty; write the token ids into it or fix the path.")
        if size % dtype.itemsize:
            raise DataError(
                f"Token file '{path}' has {size} bytes, not a multiple of {dtype.itemsize} "
                f"({cfg.dtype.value}); set TokenFile.dtype to the type it was written with, "
                f"or re-create the file if it is truncated."
            )
        try:
            tokens = np.memmap(path, dtype=dtype, mode="r")
        except OSError as e:
            raise DataError(f"Token file '{path}' cannot be mapped: {e.strerror or e}.") from None
        return split_stream(tokens, cfg.eval_fraction, split, f"Token file '{path}'")
