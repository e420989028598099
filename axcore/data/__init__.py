"""Input pipeline: tokenizers, data sources (documents) and the Grain pipeline that packs them into batches.

The pipeline's names (`InputConfig`, `InputPipeline`, `MixtureComponent`, `Packing`,
`LongDocuments`) are imported on first use: they import Grain (about 1 s on top of JAX),
which `import axcore.data.tokenizer` (the hookspecs, `axcore plugins`) does not need.
"""

from axcore.config.lazy import lazy_exports
from axcore.data.errors import DataError
from axcore.data.schema import BATCH_SCHEMA, PAD_LABEL, BatchField, BatchSchema
from axcore.data.sources import (
    CORPUS_FILES,
    ChatFiles,
    DataSource,
    EmbeddedCorpus,
    JsonlFiles,
    ParquetFiles,
    Prepared,
    RandomAccessSource,
    Split,
    StreamedSource,
    TextFiles,
    TextFormat,
    TokenDtype,
    TokenFile,
    read_corpus_documents,
)
from axcore.data.tokenizer import ByteTokenizer, Tokenizer

# Name -> the module that defines it, imported on first use.
_LAZY = {
    "InputConfig": "axcore.data.pipeline",
    "InputPipeline": "axcore.data.pipeline",
    "MixtureComponent": "axcore.data.mixture",
    "LongDocuments": "axcore.data.packing",
    "Packing": "axcore.data.packing",
}
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = [
    "BATCH_SCHEMA",
    "CORPUS_FILES",
    "PAD_LABEL",
    "BatchField",
    "BatchSchema",
    "ByteTokenizer",
    "ChatFiles",
    "DataError",
    "DataSource",
    "EmbeddedCorpus",
    "InputConfig",
    "InputPipeline",
    "JsonlFiles",
    "LongDocuments",
    "MixtureComponent",
    "Packing",
    "ParquetFiles",
    "Prepared",
    "RandomAccessSource",
    "Split",
    "StreamedSource",
    "TextFiles",
    "TextFormat",
    "TokenDtype",
    "TokenFile",
    "Tokenizer",
    "read_corpus_documents",
]
