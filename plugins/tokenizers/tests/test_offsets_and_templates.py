"""The hf_tokenizer plugin's additions for prepared shards and chat data: `fingerprint` (file bytes and
id-affecting settings, never the path), `chat_template` (tokenizer_config.json string or named list,
chat_template.jinja) and `encode_with_offsets` (the library's offsets, the same ids as encode)."""

import json
import shutil

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

pytest.importorskip("axcore_tokenizers")
from axcore_tokenizers import HFTokenizer, TokenizerFileError

TEXT = "The quick brown fox jumps over the lazy dog.\n\n  Naïve café 🚀 über   spaces <|im_end|>\nend"
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _build(directory, *, trim_offsets=None, config=None):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if trim_offsets is not None:
        tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _hf(path, **settings):
    return HFTokenizer(HFTokenizer.default_config().set(path=str(path), **settings))


def test_fingerprint_hashes_the_file_and_id_settings_not_the_path(tmp_path):
    first = _build(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "b"
    copy.mkdir(parents=True)
    shutil.copy(first / "tokenizer.json", copy / "tokenizer.json")
    base = _hf(first).fingerprint()
    assert base == _hf(copy).fingerprint() == _hf(copy / "tokenizer.json").fingerprint()
    assert set(base) == {"name", "vocab_size", "sha256"} and base["name"] == "HFTokenizer"
    json.dumps(base)  # JSON-safe.
    changed = {
        "add_bos": _hf(first, add_bos=True),
        "add_eos": _hf(first, add_eos=True),
        "eos_token": _hf(first, add_eos=True, eos_token="<|im_end|>"),
        "max_chunk_chars": _hf(first, max_chunk_chars=100),
    }
    prints = {name: tok.fingerprint()["sha256"] for name, tok in changed.items()}
    assert len(set(prints.values())) == len(prints) and base["sha256"] not in prints.values()
    assert _hf(first, skip_special_tokens=False).fingerprint() == base  # Decoding only: ids unchanged.
    edited = json.loads((copy / "tokenizer.json").read_text())
    edited["added_tokens"][0]["content"] = "<S>"
    (copy / "tokenizer.json").write_text(json.dumps(edited))
    assert _hf(copy).fingerprint()["sha256"] != base["sha256"]


@pytest.mark.parametrize("trim_offsets", [None, False, True])
def test_encode_with_offsets_gives_encodes_ids_and_the_librarys_spans(tmp_path, trim_offsets):
    directory = _build(tmp_path / "t", trim_offsets=trim_offsets)
    library = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    expected = library.encode(TEXT, add_special_tokens=False)
    for chunk in (None, 12):  # Encoded in pieces, offsets shifted back into the text.
        tok = _hf(directory, add_bos=True, add_eos=True, max_chunk_chars=chunk)
        ids, offsets = tok.encode_with_offsets(TEXT)
        assert ids.tolist() == tok.encode(TEXT).tolist() == [tok.bos_id, *expected.ids]
        assert offsets.dtype == np.int64 and offsets.shape == (len(ids), 2)
        library_offsets = np.asarray(expected.offsets, np.int64)
        assert offsets[0].tolist() == [0, 0] and offsets[1:, 1].tolist() == library_offsets[:, 1].tolist()
        # Spans start where the library's do, except that a trimming post-processor keeps the leading
        # space of a piece's first token (the piece is encoded on its own).
        for got, want in zip(offsets[1:, 0], library_offsets[:, 0]):
            assert got == want or (trim_offsets and chunk and TEXT[got:want].isspace()), (got, want)
        ids, offsets = tok.encode_with_offsets(TEXT, document=True)
        assert ids.tolist() == tok.encode_documents([TEXT])[0].tolist()
        assert offsets[-1].tolist() == [len(TEXT), len(TEXT)]
    # Without trimming, the spans read back the text: each token's span holds the characters it came from.
    if not trim_offsets:
        _, offsets = _hf(directory).encode_with_offsets(TEXT)
        assert offsets[0, 0] == 0 and offsets[-1, 1] == len(TEXT) and (offsets[1:, 0] >= offsets[:-1, 0]).all()
        im_end = TEXT.index("<|im_end|>")
        assert [im_end, im_end + len("<|im_end|>")] in offsets.tolist()


def test_chat_template_and_special_tokens_from_the_model_directory(tmp_path):
    plain = _hf(_build(tmp_path / "plain"))
    assert plain.chat_template is None
    assert plain.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    string = _hf(_build(tmp_path / "string", config={"chat_template": "{{ x }}", "pad_token": "<|im_start|>",
                                                       "eos_token": {"content": "<|im_end|>"}}))
    assert string.chat_template == "{{ x }}"
    assert string.special_tokens == {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|im_start|>"}
    named = [{"name": "rag", "template": "r"}, {"name": "default", "template": "d"}]
    assert _hf(_build(tmp_path / "named", config={"chat_template": named})).chat_template == "d"
    jinja_dir = _build(tmp_path / "jinja", config={"chat_template": "old"})
    (jinja_dir / "chat_template.jinja").write_text("new {{ y }}")
    assert _hf(jinja_dir).chat_template == "new {{ y }}"
    no_default = _hf(_build(tmp_path / "nodefault", config={"chat_template": [{"name": "rag", "template": "r"}]}))
    with pytest.raises(TokenizerFileError, match=r"lists templates \['rag'\] but none named \"default\""):
        _ = no_default.chat_template
    with pytest.raises(TokenizerFileError, match="chat_template is a int"):
        _ = _hf(_build(tmp_path / "int", config={"chat_template": 3})).chat_template
