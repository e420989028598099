"""The byte-level tokenizer: one token per UTF-8 byte."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back; token ids are 0..255.

    >>> tok = ByteTokenizer()
    >>> tok.encode("héllo").tolist()
    [104, 195, 169, 108, 108, 111]
    >>> tok.decode([104, 195, 169])
    'hé'
    """

    # Number of distinct token ids.
    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32 `[num_bytes]`, its UTF-8 encoding."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Token ids `[n]` -> text; invalid UTF-8 sequences become U+FFFD.

        Raises:
            ValueError: if an id is outside 0..255.
        """
        array = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ValueError(f"Byte token ids must lie in 0..{self.vocab_size - 1}, got {array.min()}..{array.max()}.")
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
