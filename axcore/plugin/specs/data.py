"""Registration hookspecs of the input: data sources and tokenizers.

The calling convention, the phases and the evolution policy: `axcore.plugin.hookspecs`.
"""

from __future__ import annotations

from axcore.config import Configurable
from axcore.data.tokenizer import Tokenizer
from axcore.markers import hookspec
from axcore.plugin.register_callbacks import RegisterComponent
from axcore.registry import Family, module_class_validator, registers

# -- Phase 1: registration: data -------------------------------------------------------


@registers(Family("data_sources", "data source", module_class_validator(Configurable), config_names=True))
@hookspec
def axcore_register_data_sources(register: RegisterComponent) -> None:
    """Register input data sources that configs can name with `type: <name>`.

    Args:
        register: `register(name, source_class, *, override=False)`; the class must
            subclass `axcore.data.DataSource`, a Configurable that yields documents
            (`{"tokens": int32 [n], "loss_mask": uint8 [n]}`) of a split: a
            `RandomAccessSource` (`num_documents`, `document(index)`) or a
            `StreamedSource` (`raw_documents`, `to_document`). The input pipeline
            shards, shuffles, packs and batches them (docs/data.md "Sources").

    Returns nothing. Called like the other registration hooks (built-ins first, then
    enabled plugins in `plugins:` order; the same duplicate-name rule). Names share
    the config namespace with layers and position embeddings.
    """


@registers(Family("tokenizers", "tokenizer", module_class_validator(Tokenizer), config_names=True))
@hookspec
def axcore_register_tokenizers(register: RegisterComponent) -> None:
    """Register tokenizers that the experiment's `tokenizer:` can name with `type: <name>`.

    Args:
        register: `register(name, tokenizer_class, *, override=False)`; the class must
            subclass `axcore.data.Tokenizer` (a Configurable with `vocab_size`,
            `encode(text)` -> int32 ids and `decode(ids)` -> text).

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule, one config namespace). The built-in is `bytes` (one token
    per UTF-8 byte); the end-of-run sample encodes and decodes with the chosen one.
    """
