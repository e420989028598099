"""Tokenizers: text to token ids and back. The built-in one is `bytes` (one token per UTF-8 byte).

A tokenizer is a registered `Configurable` (`axcore_register_tokenizers`) that
configs name with `type: <name>`; the experiment's `tokenizer:` picks one (the
end-of-run sample encodes its prompt and decodes its tokens with it). This file
imports neither hookspecs nor the plugin manager (hookspecs validate registrations
against `Tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Annotated

import numpy as np

from axcore.config import ClassConfig, Configurable, Positive
from axcore.errors import ConfigError


class Tokenizer(Configurable):
    """Base of registered tokenizers: `encode`, `decode` and `vocab_size`.

    `Tokenizer()` without a config builds the class's default config.
    """

    class Config(Configurable.Config):
        """Configures Tokenizer."""

    # What one token is, for labels such as loss.png's "nats per token" ("byte" for ByteTokenizer).
    token_unit: str = "token"

    def __init__(self, cfg: ClassConfig | None = None):
        super().__init__(cfg if cfg is not None else type(self).default_config())

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids (ids are 0..vocab_size - 1)."""
        raise NotImplementedError(f"{type(self).__name__} must define vocab_size.")

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32 token ids `[num_tokens]`."""
        raise NotImplementedError(f"{type(self).__name__} must implement encode(text).")

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Token ids `[n]` -> text."""
        raise NotImplementedError(f"{type(self).__name__} must implement decode(ids).")

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text encoded as one document: a list of int32 ids `[n_i]`, one per text.

        Data sources call this (not `encode` on the joined corpus), so a tokenizer may
        batch, split long documents, or mark document starts and ends. Default:
        `encode(text)` for each.
        """
        return [np.asarray(self.encode(text)) for text in texts]

    def fingerprint(self) -> dict:
        """What identifies this tokenizer's ids: `{"name", "vocab_size", "sha256"}` (JSON-safe).

        Prepared token shards record it, and training refuses shards whose fingerprint
        differs from the experiment's tokenizer. `sha256` must change whenever the ids
        of some text would (the vocabulary file, the special-token settings); the
        default hashes the class name and the config.
        """
        identity = json.dumps([type(self).__qualname__, repr(sorted(self._config.items()))])
        return {
            "name": type(self).__name__,
            "vocab_size": int(self.vocab_size),
            "sha256": hashlib.sha256(identity.encode("utf-8")).hexdigest(),
        }

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None (it has none)."""
        return None

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-sequence token, where decoding may stop, or None (it has none)."""
        return None

    @property
    def chat_template(self) -> str | None:
        """The jinja2 chat template this tokenizer ships (Hugging Face's), or None (it has none).

        `axcore.data.chat.ChatTemplate.for_tokenizer` uses it unless a template file is given.
        """
        return None

    @property
    def special_tokens(self) -> dict[str, str]:
        """Special tokens' texts by name (`{"bos_token": "<s>", "eos_token": "</s>", ...}`), passed to chat templates.

        Default: none ({}); a template that uses `bos_token` then renders it as "".
        """
        return {}

    def encode_with_offsets(self, text: str, *, document: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """`text` -> (ids int32 `[n]`, offsets int64 `[n, 2]`): token k came from `text[offsets[k, 0]:offsets[k, 1]]`.

        The ids equal `encode(text)`, or with `document=True` `encode_documents([text])[0]`
        (BOS/EOS as data sources get them). A token the tokenizer adds (BOS, EOS) has an
        empty span at the text's start or end; several tokens may share one character
        (bytes of one character). Chat data needs it to build loss masks; the default
        raises ConfigError.
        """
        raise ConfigError(
            f"tokenizer: {type(self).__name__} cannot map its tokens to character offsets (encode_with_offsets), which "
            f"chat data needs for its loss masks; use a tokenizer that can (bytes, hf) or implement encode_with_offsets."
        )


class ByteTokenizer(Tokenizer):
    """Maps text to its UTF-8 bytes and back; token ids are 0..255.

    >>> tok = ByteTokenizer()
    >>> tok.encode("héllo").tolist()
    [104, 195, 169, 108, 108, 111]
    >>> tok.decode([104, 195, 169])
    'hé'
    """

    class Config(Tokenizer.Config):
        """Configures ByteTokenizer (it has no settings)."""

    # Number of distinct token ids.
    vocab_size: Annotated[int, Positive] = 256
    # One token is one UTF-8 byte.
    token_unit = "byte"

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32 `[num_bytes]`, its UTF-8 encoding."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_with_offsets(self, text: str, *, document: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """`text` -> (its UTF-8 bytes as int32 `[n]`, int64 `[n, 2]`): each byte's span is its character's `[c, c + 1)`.

        >>> ids, offsets = ByteTokenizer().encode_with_offsets("hé")
        >>> offsets.tolist()
        [[0, 1], [1, 2], [1, 2]]
        """
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        # A byte starts a character unless it is a UTF-8 continuation byte (10xxxxxx).
        char = np.cumsum((data & 0xC0) != 0x80, dtype=np.int64) - 1
        return data.astype(np.int32), np.stack([char, char + 1], axis=1)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Token ids `[n]` -> text; invalid UTF-8 sequences become U+FFFD.

        Raises:
            ValueError: if an id is outside 0..255.
        """
        array = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ValueError(f"Byte token ids must lie in 0..{self.vocab_size - 1}, got {array.min()}..{array.max()}.")
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# Registered names of the built-in tokenizers.
TOKENIZERS = {"bytes": ByteTokenizer}
