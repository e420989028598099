"""The hf_tokenizer plugin (axcore-tokenizers): a tokenizer.json built here with the `tokenizers` library
(a tiny byte-level BPE, nothing downloaded) encodes and decodes as that library and as transformers'
PreTrainedTokenizerFast do, finds its special tokens, tokenizes text sources for `axcore train`, and
bad paths or a too-small vocabulary are one-line errors."""

import json

import numpy as np
import pytest
import tokenizers
import yaml
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import axcore
from axcore.cli import main
from axcore.data import Split
from axcore.testing import TINY_OVERRIDES
from axcore.trainer import trainer as trainer_module

pytest.importorskip("axcore_tokenizers")
from axcore_tokenizers import HFTokenizer, TokenizerFileError

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition.",
    "Sphinx of black quartz, judge my vow! Pack my box with five dozen liquor jugs.",
]
TEXT = ("\n".join(SENTENCES * 3) + "\nUnseen wörds: naïve café, 🚀 and   spaces.\n\nA new paragraph.\n"
        + '"Is he in London?"\n\n"Yes, he is; since\nMonday  last."\n 1234567 numbers, under_scores\n')
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def _build(directory, tokenizer_config=None):
    """A byte-level BPE tokenizer.json (vocab 256 + merges + 4 special tokens) in `directory`."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(SENTENCES * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("tok"))


def _hf(path, **settings):
    return HFTokenizer(HFTokenizer.default_config().set(path=str(path), **settings))


def test_encode_decode_match_the_tokenizers_library_and_transformers(tokenizer_file):
    ours = _hf(tokenizer_file)
    library = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    for text in [TEXT, *SENTENCES, "", "naïve 🚀"]:
        ids = ours.encode(text)
        assert ids.dtype == np.int32
        assert ids.tolist() == library.encode(text, add_special_tokens=False).ids
        assert ids.tolist() == fast.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text == fast.decode(ids.tolist())
    assert len(ours.encode(SENTENCES[0])) < 0.7 * len(SENTENCES[0].encode())  # Subwords, not bytes.
    assert ours.vocab_size == len(fast) == library.get_vocab_size(with_added_tokens=True)


def test_special_tokens_bos_eos_and_decoding(tmp_path, tokenizer_file):
    plain = _hf(tokenizer_file)
    assert (plain.bos_id, plain.eos_id) == (1, 2)  # Well-known names <s>, </s>.
    with_bos = _hf(tokenizer_file, add_bos=True, add_eos=True)
    body = plain.encode("The fox")
    assert with_bos.encode("The fox").tolist() == [1, *body]  # EOS never ends a prompt.
    docs = with_bos.encode_documents(["The fox", "a dog"])
    assert [d.tolist() for d in docs] == [[1, *body, 2], [1, *plain.encode("a dog"), 2]]
    assert with_bos.decode([1, *body, 2]) == "The fox"
    assert _hf(tokenizer_file, skip_special_tokens=False).decode([1, *body, 2]) == "<s>The fox</s>"
    # tokenizer_config.json names them (also in the {"content": ...} form); a directory path finds tokenizer.json.
    directory = _build(tmp_path / "repo", {"bos_token": {"content": "<pad>"}, "eos_token": "<unk>"}).parent
    from_config = _hf(directory)
    assert (from_config.bos_id, from_config.eos_id) == (3, 0) and from_config.file == directory / "tokenizer.json"
    assert _hf(directory, eos_token="</s>").eos_id == 2
    with pytest.raises(axcore.ConfigError, match="tokenizer.bos_token '<nope>' is not a token"):
        _hf(directory, bos_token="<nope>")


def _metaspace_unigram(directory):
    """A SentencePiece-style tokenizer: Unigram model, Metaspace pre-tokenizer ("▁" word starts)."""
    tok = tokenizers.Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(SENTENCES * 20 + [TEXT], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_long_documents_are_encoded_in_pieces_with_the_same_ids(tmp_path, tokenizer_file):
    for path in (tokenizer_file, _metaspace_unigram(tmp_path / "unigram")):
        whole = _hf(path, max_chunk_chars=None)
        pieces = _hf(path, max_chunk_chars=40)
        assert len(list(pieces._pieces(TEXT))) > 10 and "".join(pieces._pieces(TEXT)) == TEXT
        docs = [TEXT, SENTENCES[1], TEXT * 3]
        library = tokenizers.Tokenizer.from_file(str(path))
        for a, b, text in zip(whole.encode_documents(docs), pieces.encode_documents(docs), docs):
            assert a.tolist() == b.tolist() == library.encode(text, add_special_tokens=False).ids, path


def test_text_sources_tokenize_documents_with_it(tmp_path, tokenizer_file):
    paths = []
    for i, doc in enumerate(SENTENCES):
        paths.append(str(tmp_path / f"d{i}.txt"))
        (tmp_path / f"d{i}.txt").write_text(doc)
    source_cfg = f"input.source={{type: text_files, paths: {paths}, eval_fraction: 0.25}}"
    exp = axcore.load_experiment(
        None, [*TINY_OVERRIDES, source_cfg, "plugins=[hf_tokenizer]", f"tokenizer={{type: hf, path: {tokenizer_file}}}",
               "model.vocab_size=400", "input.seq_len=8"]
    )
    source = exp.config.input.source.instantiate()
    source.use_tokenizer(exp.config.tokenizer.instantiate())
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    documents = [source.to_document(location, raw)["tokens"].tolist() for location, raw in source.raw_documents()]
    assert documents == [fast.encode(s, add_special_tokens=False) for s in SENTENCES]  # One document per file.


def test_axcore_train_tokenizes_its_text_source_with_it(tmp_path, tokenizer_file, monkeypatch, capsys):
    corpus, held_out = tmp_path / "corpus.txt", tmp_path / "held_out.txt"
    corpus.write_text(TEXT * 4)
    held_out.write_text(SENTENCES[0])
    monkeypatch.chdir(tmp_path)  # A relative tokenizer path is made absolute against the working directory.
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    batches = []

    class Recording:
        """The TRAIN pipeline, recording each batch it hands to the trainer."""

        def __init__(self, inner):
            self._inner = inner

        def __iter__(self):
            return self

        def __next__(self):
            batches.append(next(self._inner))
            return batches[-1]

        def __getattr__(self, name):
            return getattr(self._inner, name)

    def recording_pipeline(cfg, split, *args):
        pipeline = make(cfg, split, *args)
        return Recording(pipeline) if split == Split.TRAIN else pipeline

    make = trainer_module.input_pipeline
    monkeypatch.setattr(trainer_module, "input_pipeline", recording_pipeline)
    source = f"{{type: text_files, paths: [{corpus}, {held_out}], eval_fraction: 0.5}}"  # The second file is held out.
    overrides = [*TINY_OVERRIDES, "plugins=[hf_tokenizer]", "tokenizer={type: hf, path: tok, add_bos: true}",
                 "model.vocab_size=336", f"input.source={source}", "input.shuffle=false", "input.seq_len=16",
                 "input.packing=concat", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=1",
                 "trainer.sample.num_tokens=4", "trainer.sample.temperature=0", "trainer.metrics_writers=[]",
                 f"trainer.run_dir={tmp_path / 'run'}"]
    assert main(["train", *[a for o in overrides for a in ("--set", o)]]) == 0
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    expected = [1, *fast.encode(TEXT * 4, add_special_tokens=False)]  # One document: BOS, then its ids (concat rows).
    first = batches[0]
    for row in range(4):
        window = expected[row * 16 : row * 16 + 17]
        assert first["input_ids"][row].tolist() == window[:-1] and first["target_labels"][row].tolist() == window[1:]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["tokenizer"]["path"] == str(tmp_path / "tok")  # Found again from any directory.
    monkeypatch.chdir(tmp_path / "tok")
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--data", str(corpus), "--json"]) == 0  # `axcore eval` tokenizes with it.
    assert json.loads(capsys.readouterr().out)["tokens"] == len(expected) - 1


def test_bad_path_and_too_small_vocabulary_are_one_line_errors(tmp_path, tokenizer_file, capsys):
    base = ["--set", "plugins=[hf_tokenizer]", "--set", "model.vocab_size=400"]
    assert main(["config", "default", *base, "--set", f"tokenizer={{type: hf, path: {tmp_path / 'missing.json'}}}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.json' does not exist" in err[0] and err[0].startswith("axcore: error:")
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["train", *base, "--set", f"tokenizer={{type: hf, path: {tmp_path / 'bad.json'}}}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a tokenizer file" in err[0]
    with pytest.raises(TokenizerFileError, match="holds no tokenizer.json"):
        _hf(tmp_path)
    vocab = _hf(tokenizer_file).vocab_size
    assert main(["config", "default", "--set", "plugins=[hf_tokenizer]",
                 "--set", f"tokenizer={{type: hf, path: {tokenizer_file}}}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"axcore: error: 'model.vocab_size' (256) is smaller than the tokenizer's {vocab} token ids "
                   f"(HFTokenizer); set model.vocab_size to at least {vocab}."]
