"""Input pipeline: tokenizers, data sources and a deterministic, checkpointable batch iterator."""

from axcore.data.errors import DataError
from axcore.data.iterator import PAD_LABEL, BatchIterator, InputConfig
from axcore.data.sources import (
    CORPUS_FILES,
    DOCUMENT_SEPARATOR,
    DataSource,
    EmbeddedCorpus,
    Split,
    TextFiles,
    TextFormat,
    TokenDtype,
    TokenFile,
    read_corpus_documents,
    split_documents,
    split_stream,
)
from axcore.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "CORPUS_FILES",
    "DOCUMENT_SEPARATOR",
    "PAD_LABEL",
    "BatchIterator",
    "ByteTokenizer",
    "DataError",
    "DataSource",
    "EmbeddedCorpus",
    "InputConfig",
    "Split",
    "TextFiles",
    "TextFormat",
    "TokenDtype",
    "TokenFile",
    "Tokenizer",
    "read_corpus_documents",
    "split_documents",
    "split_stream",
]
