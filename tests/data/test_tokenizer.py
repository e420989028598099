"""ByteTokenizer: UTF-8 bytes in, the same text out."""

import numpy as np
import pytest

from axcore.data import ByteTokenizer


@pytest.mark.parametrize("text", ["", "hello world", "naïve café — 東京 🚀", "line\nbreak\ttab\x00nul"])
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_vocab_and_id_range():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    ids = tok.encode("é🚀")
    assert ids.min() >= 0 and ids.max() < tok.vocab_size
    assert len(ids) == 2 + 4  # Multi-byte characters give one id per byte.


def test_invalid_utf8_is_replaced():
    tok = ByteTokenizer()
    assert tok.decode([104, 0xFF, 105]) == "h\ufffdi"
    # A window may cut a character in half: decoding still works.
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def test_out_of_range_ids_are_rejected():
    with pytest.raises(ValueError, match="0..255"):
        ByteTokenizer().decode([256])


def test_bytes_is_a_registered_configurable_tokenizer(registries):
    from axcore.config import from_dict
    from axcore.data import Tokenizer

    assert registries.tokenizers["bytes"] is ByteTokenizer
    tok = from_dict({"type": "bytes"}, registries).instantiate()
    assert isinstance(tok, Tokenizer) and isinstance(tok, ByteTokenizer)
    assert tok.encode("hé").tolist() == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
