"""Data sources: registered components that yield DOCUMENTS for a split; they never batch.

A document is `{"tokens": int32 [n], "loss_mask": uint8 [n]}` (`loss_mask` optional:
all ones; `loss_mask[i] == 1` trains on predicting token i from `tokens[:i]`), plus a
`"location"` string naming where it came from, for errors. The input pipeline
(`axcore/data/pipeline.py`) shards, shuffles, packs and batches them.

Two kinds of source:

- random access (`RandomAccessSource`): `num_documents()` and `document(i)` over all
  documents in source order: `prepared` (token shards written by `axcore prepare`),
  `embedded_corpus` (the shipped novels, one document per chapter) and `token_file`
  (one headerless token stream, cut into documents of `document_tokens`);
- streamed (`StreamedSource`): `raw_documents()` yields every document in source order,
  `to_document` tokenizes (or renders) one: `text_files`, `jsonl`, `parquet` and
  `chat`, read through `axcore.data.readers` file by file, never a whole file at once.

Held-out split (the same rule for every source): with `f = eval_fraction`, document k
(0-based, in source order) belongs to EVAL iff `floor((k + 1) f) > floor(k f)`, else
to TRAIN. So the first n documents hold exactly `floor(n f)` eval documents, spread
evenly (with f = 0.05: documents 19, 39, 59, ...); the rule needs no document count,
so a streamed source applies it as it reads, and train and eval never overlap.
`eval_fraction: 0` puts every document in TRAIN.
"""

from __future__ import annotations

import enum
import glob
import importlib.resources
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np

from axcore.config import REQUIRED, Configurable, Positive, Probability
from axcore.data.chat import ChatTemplate, TrainOn, render_chat
from axcore.data.errors import DataError
from axcore.data.readers import expand_paths, iter_chat_records, iter_text_documents
from axcore.data.shards import PreparedShards
from axcore.data.tokenizer import ByteTokenizer, Tokenizer

# The shipped novels (see `axcore/data/corpus/SOURCE.md`), in reading order.
CORPUS_FILES = (
    "sense_and_sensibility.txt",
    "pride_and_prejudice.txt",
    "northanger_abbey.txt",
    "persuasion.txt",
)
# A chapter heading of the shipped novels; each chapter (the title page joins the first) is a document.
_CHAPTER = re.compile(rb"^(?:CHAPTER|Chapter) [0-9IVXLC]+\b", re.MULTILINE)


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


def is_eval_document(index: int, eval_fraction: float) -> bool:
    """Whether document `index` (source order) is held out (module docstring)."""
    return math.floor((index + 1) * eval_fraction) > math.floor(index * eval_fraction)


def split_indices(num_documents: int, eval_fraction: float, split: Split) -> np.ndarray:
    """`[m]` (int32 below 2**31 documents, else int64): the indices of `split`'s documents, ascending.

    Computed a chunk at a time, so a corpus of many millions of documents costs 4 bytes per
    document of the split, not several float64 temporaries of the whole range.
    """
    dtype = np.int32 if num_documents < 2**31 else np.int64
    parts = []
    for start in range(0, num_documents, _SPLIT_CHUNK):
        k = np.arange(start, min(start + _SPLIT_CHUNK, num_documents), dtype=np.float64)
        held_out = np.floor((k + 1) * eval_fraction) > np.floor(k * eval_fraction)
        parts.append((np.flatnonzero(held_out if split is Split.EVAL else ~held_out) + start).astype(dtype))
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


# Documents per chunk of `split_indices`.
_SPLIT_CHUNK = 1 << 20


class DataSource(Configurable):
    """Base of data sources; see the module docstring for the two kinds.

    The pipeline calls `use_tokenizer(tokenizer, where)` once before reading (`where`
    is the config path, e.g. `input.source`, that errors name) and `check()` for a
    cheap look at the data (`axcore config` calls it too).
    """

    class Config(Configurable.Config):
        """Configures DataSource."""

        # Share of documents held out for eval (the rule in axcore/data/sources.py); 0 = no eval split.
        eval_fraction: Annotated[float, Probability] = 0.05

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._tokenizer: Tokenizer | None = None
        # The config path errors name (set by `use_tokenizer`).
        self.where = "input.source"

    def use_tokenizer(self, tokenizer: Tokenizer | None, where: str = "input.source") -> None:
        """Tokenize text with `tokenizer` (None: bytes); `where` is this source's config path."""
        self._tokenizer = tokenizer
        self.where = where

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32 token ids `[n]` with this source's tokenizer (as one document)."""
        if self._tokenizer is None or isinstance(self._tokenizer, ByteTokenizer):
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        (ids,) = self._tokenizer.encode_documents([text])
        return np.asarray(ids, np.int32).reshape(-1)

    def check(self, where: str | None = None) -> None:
        """Cheap checks (paths exist, index readable); DataError naming `where` (default: `self.where`)."""
        if where is not None:
            self.where = where
        self._check()

    def _check(self) -> None:
        """What `check` looks at; subclasses override this."""

    def describe(self) -> str:
        """How errors and logs name this source, e.g. "prepared shards 'data/web'"."""
        return type(self).__name__


class RandomAccessSource(DataSource):
    """A source whose documents can be read by index (module docstring)."""

    def num_documents(self) -> int:
        """Documents in all (both splits)."""
        raise NotImplementedError(f"{type(self).__name__} must implement num_documents().")

    def document(self, index: int) -> dict[str, Any]:
        """Document `index` in source order (module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must implement document(index).")

    def split_indices(self, split: Split) -> np.ndarray:
        """`[m]` integer indices (`split_indices`): the documents of `split`, ascending, a new array each call;
        DataError when there are none."""
        split = as_split(split)
        total = self.num_documents()
        indices = split_indices(total, self._config.eval_fraction, split)
        if len(indices) == 0:
            hint = {Split.EVAL: "add documents or raise eval_fraction", Split.TRAIN: "add documents"}[split]
            raise DataError(
                f"{self.where} ({self.describe()}): the {split.value} split holds no documents "
                f"({total} in all, eval_fraction={self._config.eval_fraction}); {hint}."
            )
        return indices


class StreamedSource(DataSource):
    """A source read front to back (module docstring): `raw_documents` then `to_document`."""

    def raw_documents(self) -> Iterator[tuple[str, Any]]:
        """Yields `(location, raw)` for every document, in source order (no tokenizing)."""
        raise NotImplementedError(f"{type(self).__name__} must implement raw_documents().")

    def to_document(self, location: str, raw: Any) -> dict[str, Any]:
        """One raw document -> a document dict (module docstring)."""
        return {"tokens": self.encode(raw), "location": location}


class EmbeddedCorpus(RandomAccessSource):
    """The English prose shipped inside axcore (four Jane Austen novels, about 2.3 MB).

    Each chapter is one document (166 in all; each novel's title page joins its first
    chapter), tokenized with the experiment's tokenizer when first read. With the
    default eval_fraction, 8 chapters spread over the novels are held out. Read through
    `importlib.resources`; nothing is downloaded.
    """

    class Config(RandomAccessSource.Config):
        """Configures EmbeddedCorpus."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._chapters: list[tuple[str, bytes]] | None = None

    def _read(self) -> list[tuple[str, bytes]]:
        if self._chapters is None:
            chapters = []
            for name, text in zip(CORPUS_FILES, read_corpus_documents()):
                starts = [0] + [m.start() for m in _CHAPTER.finditer(text)][1:]
                for number, (a, b) in enumerate(zip(starts, starts[1:] + [len(text)]), start=1):
                    chapters.append((f"embedded corpus '{name}' chapter {number}", text[a:b]))
            self._chapters = chapters
        return self._chapters

    def num_documents(self) -> int:
        return len(self._read())

    def document(self, index: int) -> dict[str, Any]:
        location, text = self._read()[index]
        return {"tokens": self.encode(text.decode("utf-8")), "location": location}

    def describe(self) -> str:
        return "the embedded corpus"


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


class Prepared(RandomAccessSource):
    """Token shards written by `axcore prepare` (docs/data.md "The shard format"): the default for real runs.

    `paths` name one or more prepared directories (or globs matching them, or their
    `index.json`); their documents are read in that order, by index, from memory maps.
    Opening costs O(number of shards), never O(tokens). The shards' tokenizer
    fingerprint must equal the experiment's tokenizer's.
    """

    class Config(RandomAccessSource.Config):
        """Configures Prepared."""

        # Prepared-shard directories (a directory, a glob matching directories, or an index.json).
        paths: list[str] = REQUIRED

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._shards: list[PreparedShards] | None = None
        self._starts: np.ndarray | None = None

    def directories(self) -> list[tuple[str, str]]:
        """`(directory, config path)` for each prepared directory `paths` names."""
        found = []
        if not self._config.paths:
            raise DataError(f"{self.where}.paths is empty; list at least one prepared-shard directory.")
        for i, entry in enumerate(self._config.paths):
            field = f"{self.where}.paths[{i}]"
            path = os.path.expanduser(entry)
            matches = sorted(glob.glob(path)) if set("*?[") & set(path) else [path]
            matches = [os.path.dirname(m) if os.path.basename(m) == "index.json" else m for m in matches]
            dirs = [m for m in matches if os.path.isdir(m)]
            if not dirs:
                raise DataError(
                    f"{field}: '{entry}' is not a prepared-shard directory (nothing there); "
                    f"run `axcore prepare` to write one, or fix the path."
                )
            found.extend((d, field) for d in dirs)
        return found

    def _open(self) -> list[PreparedShards]:
        if self._shards is None:
            shards = [PreparedShards(d, field=field) for d, field in self.directories()]
            if self._tokenizer is not None:
                fingerprint = self._tokenizer.fingerprint()
                for s, (_, field) in zip(shards, self.directories()):
                    s.check_tokenizer(fingerprint, field)
            self._starts = np.cumsum([0] + [s.num_documents for s in shards]).astype(np.int64)
            self._shards = shards
        return self._shards

    def _check(self) -> None:
        self._open()

    def num_documents(self) -> int:
        self._open()
        return int(self._starts[-1])

    def document(self, index: int) -> dict[str, Any]:
        shards = self._open()
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        document = dict(shards[k].document(int(index - self._starts[k])))
        document["location"] = f"prepared shards '{shards[k].path}' document {int(index - self._starts[k])}"
        return document

    def describe(self) -> str:
        return "prepared shards " + ", ".join(f"'{p}'" for p in self._config.paths[:2])


class TextFormat(enum.Enum):
    """How a file of a text source is read (`axcore.data.readers.iter_text_documents`)."""

    # The whole file is one document.
    TEXT = "text"
    # One JSON object per line; the string in `field` is a document (blank lines are skipped).
    JSONL = "jsonl"
    # The string column `field` of a Parquet file; each row is a document.
    PARQUET = "parquet"


_SUFFIXES = {TextFormat.TEXT: (), TextFormat.JSONL: (".jsonl",), TextFormat.PARQUET: (".parquet",)}


class TextFiles(StreamedSource):
    """Text, JSONL or Parquet files, streamed and tokenized on the fly (for small corpora and quick trials).

    `paths` entries are files, directories (every file below, filtered by the format's
    suffix for jsonl and parquet) or globs. Nothing is tokenized ahead; every epoch and
    every resume re-reads (and skips) from the start, so prepare big corpora instead.
    """

    class Config(StreamedSource.Config):
        """Configures TextFiles."""

        # Files, directories or globs to read, in this order (a leading ~ is expanded).
        paths: list[str] = REQUIRED
        # File format: "text" (a file is a document), "jsonl" (a line) or "parquet" (a row).
        format: TextFormat = TextFormat.TEXT
        # The JSONL field or Parquet column holding each document's text.
        field: str = "text"

    def files(self) -> list[str]:
        """The files `paths` names (DataError naming `<where>.paths[i]`)."""
        cfg = self._config
        if not cfg.paths:
            raise DataError(f"{self.where}.paths is empty; list at least one file, directory or glob.")
        return expand_paths(cfg.paths, f"{self.where}.paths", suffixes=_SUFFIXES[cfg.format])

    def _check(self) -> None:
        self.files()

    def raw_documents(self) -> Iterator[tuple[str, Any]]:
        for path in self.files():
            yield from iter_text_documents(path, self._config.format.value, self._config.field)

    def describe(self) -> str:
        return f"{self._config.format.value} files " + ", ".join(f"'{p}'" for p in self._config.paths[:2])


class JsonlFiles(TextFiles):
    """`text_files` with format jsonl: each line's `field` is a document."""

    class Config(TextFiles.Config):
        """Configures JsonlFiles."""

        # File format (jsonl for this source).
        format: TextFormat = TextFormat.JSONL


class ParquetFiles(TextFiles):
    """`text_files` with format parquet: each row's column `field` is a document (read in record batches)."""

    class Config(TextFiles.Config):
        """Configures ParquetFiles."""

        # File format (parquet for this source).
        format: TextFormat = TextFormat.PARQUET


# Warnings this process printed already (the train and eval pipelines each set up their sources).
_WARNED: set[str] = set()


class ChatFiles(StreamedSource):
    """Chat JSONL (`{"messages": [{"role", "content"}, ...]}` per line), streamed and rendered with a chat template.

    Each record becomes one document whose `loss_mask` trains on the assistant replies
    only (`train_on: assistant`) or on every token (`all`); see docs/data.md "Chat data
    and loss masks" (`axcore.data.chat.render_chat`).
    """

    class Config(StreamedSource.Config):
        """Configures ChatFiles."""

        # Chat JSONL files, directories (their .jsonl files) or globs, in this order.
        paths: list[str] = REQUIRED
        # The field of each line that holds the list of messages.
        field: str = "messages"
        # Which tokens carry weight: "assistant" (the replies) or "all".
        train_on: TrainOn = TrainOn.ASSISTANT
        # A jinja2 chat-template file to use instead of the tokenizer's (None: the tokenizer's, else a default).
        template: str | None = None

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._template: ChatTemplate | None = None

    def use_tokenizer(self, tokenizer: Tokenizer | None, where: str = "input.source") -> None:
        """As the base's; warns once on stderr when the chats would render with a template other than the
        tokenizer's own (`ChatTemplate.other_than_tokenizers`)."""
        super().use_tokenizer(tokenizer, where)
        warning = ChatTemplate.other_than_tokenizers(
            tokenizer if tokenizer is not None else ByteTokenizer(), self._config.template, field=f"{where}.template"
        )
        if warning is not None and warning not in _WARNED:
            _WARNED.add(warning)
            print(f"Warning: {warning}", file=sys.stderr)

    def files(self) -> list[str]:
        """The files `paths` names (DataError naming `<where>.paths[i]`)."""
        if not self._config.paths:
            raise DataError(f"{self.where}.paths is empty; list at least one chat JSONL file.")
        return expand_paths(self._config.paths, f"{self.where}.paths", suffixes=(".jsonl",))

    def _check(self) -> None:
        self.files()

    def raw_documents(self) -> Iterator[tuple[str, Any]]:
        for path in self.files():
            yield from iter_chat_records(path, self._config.field)

    def to_document(self, location: str, raw: Any) -> dict[str, Any]:
        tokenizer = self._tokenizer if self._tokenizer is not None else ByteTokenizer()
        if self._template is None:
            self._template = ChatTemplate.for_tokenizer(
                tokenizer, self._config.template, field=f"{self.where}.template"
            )
        document = render_chat(raw, tokenizer, self._template, train_on=self._config.train_on, where=location)
        document["location"] = location
        return document

    def describe(self) -> str:
        return "chat files " + ", ".join(f"'{p}'" for p in self._config.paths[:2])


class TokenDtype(enum.Enum):
    """Element type of a `TokenFile` (little-endian unsigned integers)."""

    UINT16 = "uint16"
    UINT32 = "uint32"


class TokenFile(RandomAccessSource):
    """Pre-tokenized ids in one raw headerless file, memory-mapped (never loaded whole).

    The file (e.g. `np.asarray(ids, np.uint16).tofile(path)`) keeps no document
    boundaries, so it is cut into documents of `document_tokens` tokens (the last may be
    shorter); prepared shards (`prepared`) keep real boundaries.
    """

    class Config(RandomAccessSource.Config):
        """Configures TokenFile."""

        # Path of the raw token file (a leading ~ is expanded).
        path: str = REQUIRED
        # Element type of the file: "uint16" (vocabularies up to 65,536) or "uint32".
        dtype: TokenDtype = TokenDtype.UINT16
        # Tokens per document the stream is cut into.
        document_tokens: Annotated[int, Positive] = 4096

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._tokens: np.ndarray | None = None

    def _map(self) -> np.ndarray:
        if self._tokens is None:
            cfg = self._config
            path, field = os.path.expanduser(cfg.path), f"{self.where}.path"
            dtype = np.dtype(cfg.dtype.value).newbyteorder("<")
            if not os.path.isfile(path):
                what = "is not a file" if os.path.exists(path) else "does not exist"
                raise DataError(f"Token file '{path}' ({field}) {what}; fix the path.")
            size = os.path.getsize(path)
            if size == 0 or size % dtype.itemsize:
                raise DataError(
                    f"Token file '{path}' ({field}) has {size} bytes, not a positive multiple of {dtype.itemsize} "
                    f"({cfg.dtype.value}); set its dtype to the type it was written with, or re-create the file."
                )
            self._tokens = np.memmap(path, dtype=dtype, mode="r")
        return self._tokens

    def _check(self) -> None:
        self._map()

    def num_documents(self) -> int:
        return -(-len(self._map()) // self._config.document_tokens)

    def document(self, index: int) -> dict[str, Any]:
        n = self._config.document_tokens
        tokens = np.asarray(self._map()[index * n : (index + 1) * n], np.int32)
        return {"tokens": tokens, "location": f"token file '{self._config.path}' tokens {index * n}.."}

    def describe(self) -> str:
        return f"token file '{self._config.path}'"
