"""Text sources tokenize with the experiment's tokenizer; pre-tokenized ones ignore it."""

import numpy as np
import pytest

import axcore
from axcore.data import DataError, Split, Tokenizer

from tiny import TINY


class VowelTokenizer(Tokenizer):
    """Token 0 for every vowel, 1 + byte for anything else (vocab 257): unlike bytes, easy to check."""

    class Config(Tokenizer.Config):
        """Configures VowelTokenizer (no settings)."""

    vocab_size = 257

    def encode(self, text):
        return np.asarray([0 if c in "aeiou" else 1 + b for c in text for b in c.encode("utf-8")], np.int32)

    def decode(self, ids):
        return "".join("?" if i == 0 else chr(i - 1) for i in ids)


class VowelPlugin:
    @axcore.hookimpl
    def axcore_register_tokenizers(self, register):
        register("vowels", VowelTokenizer)


def _write(tmp_path, docs):
    paths = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(doc, encoding="utf-8")
        paths.append(str(path))
    return paths


def test_text_files_are_tokenized_with_the_experiments_tokenizer(tmp_path):
    docs = ["one apple a day " * 30, "keeps the doctor away " * 30]
    paths = _write(tmp_path, docs)
    overrides = [f"input.source={{type: text_files, paths: {paths}, eval_fraction: 0.5}}", "input.seq_len=16"]
    exp = axcore.load_experiment(
        None, [*overrides, "tokenizer.type=vowels", "plugins=[vowels]", "model.vocab_size=257"], objects={"vowels": VowelPlugin()}
    )
    tokenizer = exp.config.tokenizer.instantiate()
    source = exp.config.input.source.instantiate()
    source.use_tokenizer(tokenizer)
    np.testing.assert_array_equal(source.tokens(Split.TRAIN), VowelTokenizer().encode(docs[0]))
    np.testing.assert_array_equal(source.tokens(Split.EVAL), VowelTokenizer().encode(docs[1]))
    batch = next(exp.config.input.make_iterator(Split.TRAIN, tokenizer))
    assert batch["input_ids"].max() <= 256 and (batch["input_ids"] == 0).any()  # Vowels became token 0.
    # Without a tokenizer (or with bytes), the same source gives UTF-8 bytes.
    plain = exp.config.input.source.instantiate()
    np.testing.assert_array_equal(plain.tokens(Split.TRAIN), np.frombuffer(docs[0].encode(), np.uint8))


def test_tokenizer_set_after_reading_is_refused(tmp_path):
    source = axcore.load_experiment(None, [f"input.source={{type: text_files, paths: {_write(tmp_path, ['abc ' * 50])}}}"]).config.input.source.instantiate()
    source.tokens(Split.TRAIN)
    with pytest.raises(DataError, match="before reading"):
        source.use_tokenizer(VowelTokenizer())


def test_a_tokenizer_larger_than_the_models_vocabulary_is_a_config_error():
    with pytest.raises(axcore.ConfigError, match=r"'model.vocab_size' \(256\) is smaller than the tokenizer's 257 token ids"):
        axcore.load_experiment(None, [*TINY, "tokenizer.type=vowels", "plugins=[vowels]"], objects={"vowels": VowelPlugin()})
