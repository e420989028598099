"""The shipped corpus: real English prose, at least 1 MB, with its source documented."""

import collections
import importlib.resources
import re

import numpy as np

from axcore.data import CORPUS_FILES, DOCUMENT_SEPARATOR, EmbeddedCorpus, Split, read_corpus_documents

CORPUS_DIR = importlib.resources.files("axcore.data").joinpath("corpus")


def _text():
    return "\n\n".join(doc.decode("utf-8") for doc in read_corpus_documents())


def test_corpus_is_large_and_utf8():
    docs = read_corpus_documents()
    assert len(docs) == len(CORPUS_FILES) >= 2
    total = sum(len(d) for d in docs)
    assert 1_000_000 <= total <= 3_200_000
    for doc in docs:
        doc.decode("utf-8")  # Strict: raises if not UTF-8.


def test_corpus_looks_like_english():
    text = _text()
    letters_spaces = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters_spaces / len(text) > 0.9
    words = collections.Counter(re.findall(r"[a-z]+", text.lower()))
    top = [w for w, _ in words.most_common(12)]
    for common in ("the", "and", "of", "to"):
        assert common in top
    assert text.count(" the ") / len(text.split()) > 0.02
    assert "Elizabeth" in text and "Darcy" in text


def test_no_licence_boilerplate_in_training_text():
    text = _text()
    for phrase in ("Project Gutenberg", "START OF THIS PROJECT", "www.gutenberg", "LICENSE"):
        assert phrase not in text


def test_source_md_names_package_and_licence():
    source = CORPUS_DIR.joinpath("SOURCE.md").read_text(encoding="utf-8")
    assert "r-cran-janeaustenr" in source and "1.0.0-1" in source
    assert "public domain" in source.lower() and "MIT" in source
    for name in CORPUS_FILES:
        assert name in source


def test_embedded_corpus_tokens_are_the_bytes():
    source = EmbeddedCorpus.default_config().instantiate()
    train, eval_ = source.tokens(Split.TRAIN), source.tokens(Split.EVAL)
    stream = DOCUMENT_SEPARATOR.join(read_corpus_documents())
    # Four documents are too few to split by count: the last 5% of the bytes are eval.
    assert len(eval_) == round(len(stream) * 0.05)
    assert np.concatenate([train, eval_]).tobytes() == stream
    assert train.max() < 256


def test_embedded_corpus_splits_by_document_when_it_can():
    source = EmbeddedCorpus.default_config().set(eval_fraction=0.25).instantiate()
    docs = read_corpus_documents()
    assert source.tokens(Split.EVAL).tobytes() == docs[-1]
    assert source.tokens(Split.TRAIN).tobytes() == DOCUMENT_SEPARATOR.join(docs[:-1])
