"""Built-in plugin: the data sources (embedded corpus, text/JSONL files, token files) and the `bytes` tokenizer."""

from axcore.data.sources import EmbeddedCorpus, TextFiles, TokenFile
from axcore.data.tokenizer import TOKENIZERS
from axcore.markers import hookimpl

DATA_SOURCES = {
    "embedded_corpus": EmbeddedCorpus,
    "text_files": TextFiles,
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
