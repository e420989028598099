"""Text sources tokenize with the experiment's tokenizer, document by document."""

import numpy as np
import pytest

import axcore
from axcore.data import Split, Tokenizer
from axcore.testing import TINY_OVERRIDES


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


def test_text_files_are_tokenized_with_the_experiments_tokenizer(tmp_path):
    docs = ["one apple a day " * 3, "keeps the doctor away " * 3]
    paths = []
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i}.txt").write_text(doc, encoding="utf-8")
        paths.append(str(tmp_path / f"doc{i}.txt"))
    overrides = [f"input.source={{type: text_files, paths: {paths}, eval_fraction: 0.5}}", "input.seq_len=128",
                 "input.batch_size=1", "input.shuffle=false"]
    exp = axcore.load_experiment(
        None, [*overrides, "tokenizer.type=vowels", "plugins=[vowels]", "model.vocab_size=257"], objects={"vowels": VowelPlugin()}
    )
    tokenizer = exp.config.tokenizer.instantiate()
    for split, doc in ((Split.TRAIN, docs[0]), (Split.EVAL, docs[1])):
        batch = next(exp.config.input.make_pipeline(split, tokenizer, vocab_size=257))
        ids = VowelTokenizer().encode(doc)
        n = len(ids) - 1
        np.testing.assert_array_equal(batch["input_ids"][0, :n], ids[:-1])
        np.testing.assert_array_equal(batch["target_labels"][0, :n], ids[1:])
        assert np.all(batch["segment_ids"][0, :n] == 1) and np.all(batch["segment_ids"][0, n:] != 1)
    # Without a tokenizer, the same source gives UTF-8 bytes.
    plain = next(exp.config.input.make_pipeline(Split.TRAIN))
    assert bytes(plain["input_ids"][0, : len(docs[0]) - 1].astype(np.uint8)).decode() == docs[0][:-1]


def test_a_tokenizer_larger_than_the_models_vocabulary_is_a_config_error():
    with pytest.raises(axcore.ConfigError, match=r"'model.vocab_size' \(256\) is smaller than the tokenizer's 257 token ids"):
        axcore.load_experiment(None, [*TINY_OVERRIDES, "tokenizer.type=vowels", "plugins=[vowels]"], objects={"vowels": VowelPlugin()})
