"""Built-in plugin: the data sources (prepared shards, embedded corpus, text/JSONL/Parquet/chat files, token files) and the `bytes` tokenizer."""

from axcore.data.sources import ChatFiles, EmbeddedCorpus, JsonlFiles, ParquetFiles, Prepared, TextFiles, TokenFile
from axcore.data.tokenizer import TOKENIZERS
from axcore.markers import hookimpl

# Registered names of the built-in data sources (configs say `type: <name>`).
DATA_SOURCES = {
    "prepared": Prepared,
    "embedded_corpus": EmbeddedCorpus,
    "text_files": TextFiles,
    "jsonl_files": JsonlFiles,
    "parquet_files": ParquetFiles,
    "chat": ChatFiles,
    "token_file": TokenFile,
}


@hookimpl
def axcore_register_data_sources(register):
    for name, source in DATA_SOURCES.items():
        register(name, source)


@hookimpl
def axcore_register_tokenizers(register):
    for name, tokenizer in TOKENIZERS.items():
        register(name, tokenizer)
