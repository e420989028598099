"""axcore.serving.TextFrontend's text of token ids, against the bytes they stand for."""

from axcore.data.tokenizer import ByteTokenizer
from axcore.serving import TextFrontend


def test_ids_past_the_tokenizers_vocabulary_have_no_text():
    """A model whose vocabulary (260) is padded past its tokenizer's (256 bytes) may sample or be prompted with
    ids 256..259: their text (a logprobs entry, an echoed prompt) is empty, the others' is their bytes."""
    frontend = TextFrontend(ByteTokenizer(), vocab_size=260)
    assert frontend.encode([104, 257, 105]) == (104, 257, 105)  # A valid prompt for the model.
    data = "hé!".encode()
    assert frontend.text([data[0], 259, data[1], 256, data[2], data[3]]) == data.decode() == "hé!"
    assert (frontend.token_text(258), frontend.token_text(ord("h"))) == ("", "h")
