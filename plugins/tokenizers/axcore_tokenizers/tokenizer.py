"""`HFTokenizer`: a Hugging Face `tokenizer.json` (the `tokenizers` library) as an axcore tokenizer.

    plugins: [hf_tokenizer]
    tokenizer: {type: hf, path: models/llama/tokenizer.json, add_bos: true}
    model: {vocab_size: 32000}          # must cover the tokenizer's ids

`path` names a `tokenizer.json` or a directory holding one (a Hugging Face model
repository's files). Every tokenizer the `tokenizers` library reads works: byte-level
BPE (GPT-2, Llama 3), WordPiece, Unigram, and the SentencePiece models that Hugging
Face repositories ship converted into `tokenizer.json` (Llama 2, Mistral, Gemma), so
no `sentencepiece` install is needed.

Special tokens: `bos_id`/`eos_id` come from the config's `bos_token`/`eos_token` if
set, else from `tokenizer_config.json` beside the tokenizer file (its `bos_token` and
`eos_token`), else from the first of a few well-known names the vocabulary holds
(`<|begin_of_text|>`, `<s>`, ...; `<|end_of_text|>`, `<|endoftext|>`, `</s>`, ...),
else None. Text is always encoded without the file's own post-processor (Hugging
Face's `add_special_tokens=False`); `add_bos` puts `bos_id` first, and, for data
sources, `add_eos` puts `eos_id` after each document.

Prepared shards and chat data: `fingerprint()` hashes the tokenizer.json bytes and the
id-affecting settings (never the path); `chat_template` is `chat_template.jinja` beside
the file or tokenizer_config.json's "chat_template" (string, or the named list's
"default"); `encode_with_offsets` gives the library's character offsets per token.

Data sources encode documents with `encode_documents`: in batches (the library's
parallel `encode_batch`), and a document longer than `max_chunk_chars` in pieces, each
cut just before a space that lies between two letters ("word| word"). Such a cut is a
pre-token boundary of the byte-level BPE regexes (GPT-2, Llama 3: a letter run never
takes the following space, and " word" starts a pre-token), of whitespace/punctuation
splitters (WordPiece) and of Metaspace (the piece starts with the space, so no extra
"▁" is prepended), so the ids equal encoding the document whole. Tokenizers whose
normalizer prepends "▁" to every text (older Llama 2 / Mistral conversions,
`Prepend` normalizer) get one extra "▁" per cut, which `max_chunk_chars: null` avoids.
(Cutting at newlines would not be exact: a whitespace run at a piece's end is
pre-tokenized differently.)
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any

import numpy as np
import tokenizers

from axcore.config import REQUIRED, Positive
from axcore.data import Tokenizer
from axcore.errors import ConfigError

# File names inside a model directory.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# A chat template file beside tokenizer.json (transformers' newer format; wins over tokenizer_config.json's).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# tokenizer_config.json entries passed to chat templates besides bos_token and eos_token (when they name a token).
_TEMPLATE_TOKENS = ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# Tried in order when neither the config nor tokenizer_config.json names the token.
KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
# Texts per `encode_batch` call (bounds the memory of the library's Encoding objects).
_BATCH = 256
# A cut point: just before a space between two letters.
_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")


class TokenizerFileError(ConfigError):
    """The tokenizer file (or its tokenizer_config.json) is missing or unreadable (the message names it)."""


def find_tokenizer_file(path: str | os.PathLike) -> pathlib.Path:
    """`path` if it is a file, else `path/tokenizer.json`; a leading ~ is expanded.

    Raises:
        TokenizerFileError: neither exists.
    """
    given = pathlib.Path(os.path.expanduser(os.fspath(path)))
    candidate = given / TOKENIZER_FILE if given.is_dir() else given
    if not candidate.is_file():
        what = f"directory '{given}' holds no {TOKENIZER_FILE}" if given.is_dir() else f"'{given}' does not exist"
        raise TokenizerFileError(
            f"tokenizer.path: {what}; point it at a Hugging Face {TOKENIZER_FILE} or the model directory holding one "
            f"(relative paths are relative to the working directory)."
        )
    return candidate


def _token_content(value: Any) -> str | None:
    """A tokenizer_config.json token entry (`"<s>"` or `{"content": "<s>", ...}`) as its text."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, encoded and decoded by the `tokenizers` library (module docstring).

    >>> tok = HFTokenizer(HFTokenizer.default_config().set(path="tokenizer.json"))  # doctest: +SKIP
    >>> tok.decode(tok.encode("Hello")) == "Hello"                                 # doctest: +SKIP
    True
    """

    class Config(Tokenizer.Config):
        """Configures HFTokenizer."""

        # A tokenizer.json, or a directory holding one (relative: to the working directory). Required.
        path: str = REQUIRED
        # Put the BOS token before the ids of every encoded text (prompts and documents).
        add_bos: bool = False
        # Put the EOS token after every document a data source encodes (never after a prompt).
        add_eos: bool = False
        # Whether decode drops special tokens (BOS, EOS, padding, chat markers).
        skip_special_tokens: bool = True
        # The BOS token's text; None = tokenizer_config.json's bos_token, else a well-known name.
        bos_token: str | None = None
        # The EOS token's text (decoding stops there); None = tokenizer_config.json's, else a well-known name.
        eos_token: str | None = None
        # Documents longer than this many characters are encoded in pieces cut between words; None = whole.
        max_chunk_chars: Annotated[int, Positive] | None = 1 << 20

    def __init__(self, cfg: Config | None = None):
        super().__init__(cfg)
        cfg = self._config
        # The tokenizer.json read.
        self.file = find_tokenizer_file(cfg.path)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.file))
        except Exception as e:  # The library raises a bare Exception with the parser's message.
            raise TokenizerFileError(
                f"tokenizer.path: '{self.file}' is not a tokenizer file the `tokenizers` library ({tokenizers.__version__}) "
                f"reads: {' '.join(str(e).split())}; pass a Hugging Face {TOKENIZER_FILE}."
            ) from None
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        settings = self._read_tokenizer_config()
        self._settings = settings
        self._file_sha256: str | None = None
        self._bos_id = self._special_id(cfg.bos_token, settings.get("bos_token"), KNOWN_BOS, "bos_token", vocab)
        self._eos_id = self._special_id(cfg.eos_token, settings.get("eos_token"), KNOWN_EOS, "eos_token", vocab)
        for flag, token_id, name in ((cfg.add_bos, self._bos_id, "bos"), (cfg.add_eos, self._eos_id, "eos")):
            if flag and token_id is None:
                raise ConfigError(
                    f"tokenizer.add_{name} is set but '{self.file}' has no {name.upper()} token that axcore can find; "
                    f"set tokenizer.{name}_token to its text."
                )

    def _read_tokenizer_config(self) -> dict:
        """tokenizer_config.json beside the tokenizer file, or {} (none there)."""
        path = self.file.parent / TOKENIZER_CONFIG_FILE
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerFileError(
                f"'{path}' cannot be read as JSON ({e}); fix or remove it (it names the BOS and EOS tokens)."
            ) from None
        return data if isinstance(data, dict) else {}

    def _special_id(
        self, configured: str | None, from_file: Any, known: Sequence[str], field: str, vocab: dict[str, int]
    ) -> int | None:
        if configured is not None:
            if configured not in vocab:
                raise ConfigError(f"tokenizer.{field} '{configured}' is not a token of '{self.file}'; fix the text.")
            return vocab[configured]
        text = _token_content(from_file)
        if text is not None and text in vocab:
            return vocab[text]
        return next((vocab[t] for t in known if t in vocab), None)

    # -- The Tokenizer interface --------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1, added tokens included (what `model.vocab_size` must cover)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-sequence token (generation stops there), or None."""
        return self._eos_id

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32 ids `[num_tokens]` (BOS first if `add_bos`)."""
        return self._with_specials(self._encode_pieces([text]), eos=False)

    def encode_with_offsets(self, text: str, *, document: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """`text` -> (int32 ids `[n]`, int64 character spans `[n, 2]`), the library's `Encoding.offsets`.

        The ids equal `encode(text)` (`document=True`: `encode_documents([text])[0]`, so EOS
        per `add_eos`); long texts are encoded in the same pieces, their offsets shifted back
        into `text`. BOS gets the empty span (0, 0), EOS (len, len). Offsets are the
        library's: a token inside a multi-byte character spans that character, and
        tokenizers whose post-processor trims offsets (`trim_offsets`) give whitespace-only
        tokens an empty span (and the first token of a piece keeps its leading space).
        """
        pieces = list(self._pieces(text))
        ids, spans = [], []
        start = 0
        for group in range(0, len(pieces), _BATCH):
            batch = pieces[group : group + _BATCH]
            for piece, encoding in zip(batch, self._tokenizer.encode_batch(batch, add_special_tokens=False)):
                ids.append(np.asarray(encoding.ids, np.int32))
                spans.append(np.asarray(encoding.offsets, np.int64).reshape(-1, 2) + start)
                start += len(piece)
        eos = document and self._config.add_eos
        if self._config.add_bos:
            spans.insert(0, np.zeros((1, 2), np.int64))
        if eos:
            spans.append(np.full((1, 2), len(text), np.int64))
        return self._with_specials(ids, eos=eos), np.concatenate(spans)

    @property
    def chat_template(self) -> str | None:
        """`chat_template.jinja` beside the tokenizer file, else `tokenizer_config.json`'s "chat_template", else None.

        The config's value may be a string or Hugging Face's list of named templates
        (`[{"name": "default", "template": ...}, ...]`), of which "default" is used.

        Raises:
            TokenizerFileError: unreadable template file, a list without "default", or a value of another type.
        """
        path = self.file.parent / CHAT_TEMPLATE_FILE
        if path.is_file():
            try:
                return path.read_text("utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerFileError(f"'{path}' cannot be read ({e}); fix or remove it.") from None
        value = self._settings.get("chat_template")
        where = self.file.parent / TOKENIZER_CONFIG_FILE
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            if isinstance(named.get("default"), str):
                return named["default"]
            raise TokenizerFileError(
                f"'{where}': chat_template lists templates {sorted(map(str, named))} but none named \"default\"; "
                f"pass the template to use as a file (the chat source's template setting)."
            )
        raise TokenizerFileError(
            f"'{where}': chat_template is a {type(value).__name__}, not a template string or a list of named templates; fix it."
        )

    @property
    def special_tokens(self) -> dict[str, str]:
        """`bos_token`/`eos_token` (the tokens `bos_id`/`eos_id` name) and tokenizer_config.json's unk/pad/sep/cls/mask tokens."""
        out = {}
        for name, token_id in (("bos_token", self._bos_id), ("eos_token", self._eos_id)):
            if token_id is not None:
                out[name] = self._tokenizer.id_to_token(token_id)
        for name in _TEMPLATE_TOKENS:
            text = _token_content(self._settings.get(name))
            if text is not None:
                out[name] = text
        return out

    def fingerprint(self) -> dict:
        """`{"name", "vocab_size", "sha256"}`: sha256 over the tokenizer.json bytes and the id-affecting settings.

        Those settings are `add_bos`, `add_eos`, the BOS id (when `add_bos`), the EOS id
        (when `add_eos`) and `max_chunk_chars`; never the path, so the same file anywhere
        gives the same fingerprint.
        """
        if self._file_sha256 is None:
            self._file_sha256 = hashlib.sha256(self.file.read_bytes()).hexdigest()
        cfg = self._config
        identity = {
            "tokenizer.json": self._file_sha256,
            "add_bos": cfg.add_bos,
            "add_eos": cfg.add_eos,
            "bos_id": self._bos_id if cfg.add_bos else None,
            "eos_id": self._eos_id if cfg.add_eos else None,
            "max_chunk_chars": cfg.max_chunk_chars,
        }
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()
        return {"name": type(self).__name__, "vocab_size": int(self.vocab_size), "sha256": digest}

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text as one document: int32 ids `[n_i]` per text, with BOS/EOS per `add_bos`/`add_eos`.

        Encoded in batches; long documents in pieces (module docstring).
        """
        out = []
        for start in range(0, len(texts), _BATCH):
            group = texts[start : start + _BATCH]
            pieces = [list(self._pieces(t)) for t in group]
            flat = self._encode_pieces([p for ps in pieces for p in ps])
            offsets = np.cumsum([0] + [len(ps) for ps in pieces])
            for i in range(len(group)):
                out.append(self._with_specials(flat[offsets[i] : offsets[i + 1]], eos=self._config.add_eos))
        return out

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Token ids `[n]` -> text; special tokens dropped if `skip_special_tokens` (ids past the vocabulary too)."""
        ids = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        return self._tokenizer.decode(ids.tolist(), skip_special_tokens=self._config.skip_special_tokens)

    # -- Helpers --------------------------------------------------------------------------

    def _pieces(self, text: str) -> Iterator[str]:
        """`text` cut just before spaces between letters, into pieces of about `max_chunk_chars` (module docstring)."""
        limit = self._config.max_chunk_chars
        start = 0
        while limit is not None and len(text) - start > limit:
            match = _CUT.search(text, start + limit)
            if match is None:
                break
            yield text[start : match.start()]
            start = match.start()
        yield text[start:]

    def _encode_pieces(self, texts: list[str]) -> list[np.ndarray]:
        """int32 ids of each text, without the file's post-processing; batched."""
        out = []
        for start in range(0, len(texts), _BATCH):
            encodings = self._tokenizer.encode_batch(texts[start : start + _BATCH], add_special_tokens=False)
            out.extend(np.asarray(e.ids, np.int32) for e in encodings)
        return out

    def _with_specials(self, pieces: Sequence[np.ndarray], *, eos: bool) -> np.ndarray:
        parts = [np.asarray([self._bos_id], np.int32)] if self._config.add_bos else []
        parts += list(pieces)
        if eos:
            parts.append(np.asarray([self._eos_id], np.int32))
        return np.concatenate(parts) if parts else np.zeros((0,), np.int32)
