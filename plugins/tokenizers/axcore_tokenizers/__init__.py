"""axcore-tokenizers: Hugging Face `tokenizer.json` tokenizers for axcore.

Enable with `plugins: [hf_tokenizer]` and name one with `tokenizer: {type: hf, path: ...}`
(see `HFTokenizer`). Importing this package registers nothing; axcore calls the hooks
in `plugin`.
"""

from axcore_tokenizers.tokenizer import HFTokenizer, TokenizerFileError, find_tokenizer_file

__all__ = ["HFTokenizer", "TokenizerFileError", "find_tokenizer_file"]
