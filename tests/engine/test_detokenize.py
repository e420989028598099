"""axcore.engine.detokenize against the whole decode (the truth): the text streamed step by step is
always the decode of every id so far without an incomplete character, its concatenation is the
decode of all ids, cut before the first stop string; multi-byte characters and stop strings split
across tokens, a stop string inside the first token; the bytes tokenizer, a word-level one and
Hugging Face byte-level BPE and Metaspace (SentencePiece-style) tokenizers."""

import numpy as np
import pytest

from axcore.data.tokenizer import ByteTokenizer, Tokenizer
from axcore.engine.detokenize import IncrementalDetokenizer

TEXT = "héllo €uro 🚀 naïve, ça va? 日本語 done."


def np_truth(data: bytes, stop=()):
    """Reference for byte ids: the text of complete characters, cut before the earliest stop string."""
    text = data.decode("utf-8", errors="replace").rstrip("\ufffd") if data else ""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def _stream(detok, ids, chunks):
    """Feeds `ids` in pieces of the sizes `chunks` cycles through; returns the deltas and stop flags."""
    deltas, flags, start, i = [], [], 0, 0
    while start < len(ids):
        size = chunks[i % len(chunks)]
        delta, stopped = detok.update(ids[start : start + size])
        deltas.append(delta)
        flags.append(stopped)
        start, i = start + size, i + 1
    return deltas, flags


@pytest.mark.parametrize("chunks", [[1], [2, 1, 3], [5]])
def test_multibyte_characters_split_across_tokens_are_held_back_until_complete(chunks):
    data = TEXT.encode("utf-8")
    detok = IncrementalDetokenizer(ByteTokenizer())
    sent, start, i = "", 0, 0
    while start < len(data):
        end = start + chunks[i % len(chunks)]
        delta, stopped = detok.update(list(data[start:end]))
        sent += delta
        assert "\ufffd" not in delta and not stopped
        assert sent == np_truth(data[:end])  # Every complete character, as soon as it is complete.
        start, i = end, i + 1
    assert sent == TEXT and detok.update([], final=True) == ("", False)
    assert detok.kept_tokens == len(data)


def test_final_flushes_an_incomplete_character_as_the_whole_decode_does():
    data = "ok €".encode("utf-8")[:-1]  # The euro sign's last byte never comes.
    detok = IncrementalDetokenizer(ByteTokenizer())
    streamed = "".join(detok.update([b])[0] for b in data)
    assert streamed == "ok "
    assert streamed + detok.update([], final=True)[0] == ByteTokenizer().decode(list(data)) == "ok \ufffd"


@pytest.mark.parametrize("stop", [("STOP",), ("zzz", "STOP"), ("OP!", "STOP"), (" €u",), ("aab",)])
def test_stop_strings_split_across_tokens_cut_the_text_before_the_earliest(stop):
    text = "Hello aaab wörld €uro, STOP! more text STOP again"
    data = text.encode("utf-8")
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=stop)
    sent, stopped_at = "", None
    for end in range(1, len(data) + 1):
        delta, stopped = detok.update([data[end - 1]])
        sent += delta
        if stopped:
            stopped_at = end
            break
        # The truth so far less its longest tail that could still become a stop string.
        truth = np_truth(data[:end], stop)
        held = max((k for s in stop for k in range(1, len(s)) if truth.endswith(s[:k])), default=0)
        assert sent == truth[: len(truth) - held]
    expected = np_truth(data, stop)
    assert sent == expected == detok.text and detok.stopped
    # It stops on the token that completes the earliest stop string; that string's tokens are dropped.
    first = min(text.find(s) for s in stop if s in text)
    match = next(s for s in stop if text.find(s) == first)
    assert stopped_at == len(text[: first + len(match)].encode("utf-8"))
    assert detok.kept_tokens == len(expected.encode("utf-8"))
    assert detok.update([65], final=True) == ("", True)


def test_final_returns_a_held_back_tail_that_never_became_a_stop_string():
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["STOP"])
    assert "".join(detok.update([b])[0] for b in b"the end ST") == "the end "
    assert detok.update([], final=True) == ("ST", False) and detok.text == "the end ST"


class WordTokenizer(Tokenizer):
    """Each id is a whole string of `WORDS` (several characters per token), decoded by concatenation."""

    class Config(Tokenizer.Config):
        """Configures WordTokenizer (no settings)."""

    WORDS = ["Hi.\nBye", " there", "\n", "By", "e", "!", " ok"]
    vocab_size = len(WORDS)

    def encode(self, text):
        raise NotImplementedError("decode only")

    def decode(self, ids):
        return "".join(self.WORDS[int(i)] for i in ids)


def test_a_stop_string_inside_the_first_token_ends_the_text_before_it():
    detok = IncrementalDetokenizer(WordTokenizer(), stop=["\n"])
    assert detok.update([0, 1]) == ("Hi.", True)
    assert detok.text == "Hi." and detok.kept_tokens == 1


def test_a_stop_string_over_several_multi_character_tokens():
    tok = WordTokenizer()
    ids = [1, 5, 3, 4, 6]  # " there" "!" "By" "e" " ok"
    detok = IncrementalDetokenizer(tok, stop=["!Bye"])
    deltas, flags = _stream(detok, ids, [1])
    assert deltas == [" there", "", "", "", ""] and flags == [False, False, False, True, True]  # Nothing after a stop.
    assert detok.text == tok.decode(ids)[: tok.decode(ids).find("!Bye")] and detok.kept_tokens == 1


def _hf_tokenizer(directory, kind):
    """A small trained Hugging Face tokenizer.json ("bytelevel" BPE or "metaspace" BPE) as axcore's HFTokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    hf = pytest.importorskip("axcore_tokenizers").HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if kind == "bytelevel":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = sorted(set(TEXT + "▁abcdefghijklmnopqrstuvwxyzHS.,!?"))
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([TEXT, "Hello there, Sam. Hello again!"] * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return hf(hf.default_config().set(path=str(directory / "tokenizer.json"), eos_token="</s>"))


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_hugging_face_tokenizers_stream_the_whole_decode(tmp_path, kind):
    tok = _hf_tokenizer(tmp_path / kind, kind)
    prompt = [int(i) for i in tok.encode("Hello there, Sam.")]
    output = [int(i) for i in tok.encode(" " + TEXT)] + [tok.eos_id]  # EOS: a special token, decoded as "".
    assert len(output) < len(TEXT)  # Tokens of several characters, and of parts of one (byte-level).
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    sent = ""
    for end in range(1, len(output) + 1):
        sent += detok.update(output[end - 1 : end])[0]
        truth = tok.decode(prompt + output[:end])[len(tok.decode(prompt)) :]
        # All of it, unless the last token ends inside a character (then at most that token's text waits).
        assert truth.startswith(sent) and (sent == truth or truth.endswith("\ufffd"))
    sent += detok.update([], final=True)[0]
    assert sent == tok.decode(prompt + output)[len(tok.decode(prompt)) :] and sent.strip() == TEXT
    # Without the prompt, the first token's text is decoded alone (the truth is the output's own decode).
    alone = IncrementalDetokenizer(tok)
    assert "".join(alone.update([t])[0] for t in output) + alone.update([], final=True)[0] == tok.decode(output)


def test_stop_strings_are_non_empty():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(ByteTokenizer(), stop=[""])
    assert np.asarray(ByteTokenizer().encode("é")).tolist() == [195, 169]


def test_ids_past_the_tokenizers_vocabulary_add_no_text():
    """A model's vocabulary padded past its tokenizer's (ids 256.. here) can sample ids that have no text: they
    count as tokens (for the tokens kept before a stop string) but the text is the decode of the others, even
    inside a split character and in the prompt's context."""
    data = "hé, ok".encode()
    ids = [data[0], data[1], 300, data[2], 256, *data[3:], 511]
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("ok",), context_ids=[65, 400])
    deltas, flags = _stream(detok, ids, [1])
    assert "".join(deltas) == np_truth(data, ("ok",)) == "hé, "
    assert flags[-1] and not flags[-3]
    assert detok.kept_tokens == ids.index(ord(" ")) + 1  # Up to the space: the stop string's tokens are dropped.
