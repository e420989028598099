"""The shipped corpus: real English prose, at least 1 MB, with its source documented."""

import collections
import importlib.resources
import re

import numpy as np

from axcore.data import CORPUS_FILES, EmbeddedCorpus, Split, read_corpus_documents

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


def test_embedded_corpus_documents_are_the_chapters_in_bytes():
    source = EmbeddedCorpus.default_config().instantiate()
    texts = [bytes(source.document(i)["tokens"].astype(np.uint8)) for i in range(source.num_documents())]
    assert b"".join(texts) == b"".join(read_corpus_documents())  # Every byte, once, in order.
    # One document per chapter heading (the title page joins the first chapter of its novel).
    headings = sum(len(re.findall(rb"(?m)^(?:CHAPTER|Chapter) [0-9IVXLC]+\b", d)) for d in read_corpus_documents())
    assert len(texts) == headings == 166
    starts = [i for i, t in enumerate(texts) if not re.match(rb"(?:CHAPTER|Chapter) [0-9IVXLC]+\b", t)]
    assert len(starts) == len(CORPUS_FILES) and starts[0] == 0  # Only each novel's first document (its title page).


def test_embedded_corpus_holds_out_spread_chapters():
    source = EmbeddedCorpus.default_config().instantiate()
    held_out = source.split_indices(Split.EVAL)
    assert list(held_out) == [k for k in range(166) if int((k + 1) * 0.05) > int(k * 0.05)]
    assert len(held_out) == 8 and not set(held_out) & set(source.split_indices(Split.TRAIN))
