"""The hf_tokenizer plugin: registers the `hf` tokenizer and pins its path.

`plugins: [hf_tokenizer]` makes `tokenizer: {type: hf, path: ...}` available. Its
config transform makes a relative `tokenizer.path` absolute (against the working
directory, as data file paths are), so a run directory's saved config, which loads
without running transforms again, still finds the tokenizer from any directory
(`axcore eval RUN`, `load_model`). An experiment that enables the plugin without
using `type: hf` is left unchanged.
"""

from __future__ import annotations

import os

from axcore import hookimpl
from axcore.config import is_config_of

from axcore_tokenizers.tokenizer import HFTokenizer

# Registered tokenizer name (`tokenizer: {type: hf}`).
TOKENIZER_NAME = "hf"


@hookimpl
def axcore_register_tokenizers(register):
    register(TOKENIZER_NAME, HFTokenizer)


@hookimpl
def axcore_transform_config(config):
    tokenizer = config.tokenizer
    path = getattr(tokenizer, "path", None) if is_config_of(tokenizer, HFTokenizer) else None
    if not isinstance(path, str) or os.path.isabs(os.path.expanduser(path)):
        return config
    new = config.clone()
    new.tokenizer.path = os.path.abspath(os.path.expanduser(path))
    return new
