"""Incremental detokenizing and stop strings: one `IncrementalDetokenizer` per choice.

Each step the scheduler feeds a choice's new token ids; `update` returns the text that
became final since the last call and whether a stop string ended the choice.

Text: decoding the whole id list is the truth. Decoding it again every step would cost
O(length) per token, so the detokenizer decodes a window (after vLLM's incremental
detokenizer): `prefix_text = decode(ids[prefix:read])` and `text = decode(ids[prefix:])`;
the new text is `text[len(prefix_text):]`, and the window moves on (`prefix = read`,
`read = len(ids)`) only when that text is complete. A text ending in U+FFFD is an
incomplete UTF-8 sequence (a character whose bytes are split across tokens, with the
bytes tokenizer or a byte-level BPE) and is held back until the next token completes it.
Decoding a window that starts a few tokens before the new ones keeps what depends on the
previous token (SentencePiece's "▁" becoming a space, WordPiece's "##") right. With
`context_ids` (the prompt's last ids) the first output tokens are decoded after them,
so a leading space that belongs to the first output token is kept.

Stop strings: the text ends just before the earliest occurrence of any stop string
(the string itself is not part of it), and the choice stops. While streaming, the
longest tail of the text that could still grow into a stop string is held back, so text
already returned never has to be taken back. `final=True` (the choice ended for another
reason: a stop token, its length) flushes what was held back, an incomplete character
included (as U+FFFD, as the whole decode has it).

Ids past the tokenizer's vocabulary (`tokenizer.vocab_size`; a model's embedding padded
beyond its tokenizer, as many Hugging Face models are, can sample them) have no text: they
count as output tokens but add nothing to the text (as vLLM decodes them to "").

Known limit: a decoder that rewrites text before the window's start once later tokens
arrive (transformers' `clean_up_tokenization_spaces`, which axcore's tokenizers do not
apply) would differ from the whole decode; the window of a few tokens covers the rules
of the `tokenizers` library's decoders.
"""

from __future__ import annotations

from collections.abc import Sequence

from axcore.data.tokenizer import Tokenizer

# Prompt ids decoded before the first output token (vLLM uses 5): enough for a decoder's
# look-back (a SentencePiece space, a WordPiece continuation).
CONTEXT_TOKENS = 5
# What a lossy UTF-8 decode puts where a character is incomplete.
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one choice's token ids into text, step by step, and matches its stop strings.

    Args:
        tokenizer: axcore's tokenizer of the engine (`decode(ids) -> str`).
        stop: strings that end the choice (the text stops before the first one).
        context_ids: ids decoded before the output's (the prompt's; its last
            `CONTEXT_TOKENS` are used), never part of the text returned.

    Attributes:
        text: the choice's text so far, held-back tail included (ends before a matched stop string).
        stopped: whether a stop string ended the choice.
        kept_tokens: output tokens whose text begins before the end of `text` when a
            stop string matched (the tokens of the stop string are dropped); until then
            every token fed.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), context_ids: Sequence[int] = ()):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"Stop strings must be non-empty strings, got {tuple(stop)!r}.")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        # Token ids with text: 0..vocab - 1.
        self._vocab = int(tokenizer.vocab_size)
        self._ids = _stable_context(tokenizer, [int(t) for t in context_ids if self._has_text(t)][-CONTEXT_TOKENS:])
        self._prefix, self._read = 0, len(self._ids)
        self.text = ""
        self._sent = 0  # Characters of `text` returned so far.
        self._starts: list[int] = []  # Per output token: len(text) when it was fed.
        self.stopped = False
        self.kept_tokens = 0

    def update(self, new_ids: Sequence[int], *, final: bool = False) -> tuple[str, bool]:
        """Feeds the choice's next token ids; returns (the text that became final, stopped).

        `final=True` says no token follows: everything held back is returned. After a
        stop string matched, further calls return ("", True).
        """
        if self.stopped:
            return "", True
        for token in new_ids:
            self._starts.append(len(self.text))
            if self._has_text(token):
                self._ids.append(int(token))
                self.text += self._decode_new(flush=False)
        if final:
            self.text += self._decode_new(flush=True)
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            self.kept_tokens = sum(start < cut for start in self._starts)
        else:
            self.kept_tokens = len(self._starts)
        end = len(self.text) if final or self.stopped else len(self.text) - self._stop_prefix_tail()
        delta, self._sent = self.text[self._sent : end], max(self._sent, end)
        return delta, self.stopped

    def _has_text(self, token: int) -> bool:
        """Whether the tokenizer knows `token` (ids past its vocabulary decode to no text)."""
        return 0 <= int(token) < self._vocab

    def _decode_new(self, *, flush: bool) -> str:
        """Text added since the window last moved, or "" while it ends in an incomplete
        character (unless `flush`); moves the window when it returns text."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or (text.endswith(REPLACEMENT) and not flush):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def _first_stop(self) -> int | None:
        """Where the earliest stop string in the text not yet returned starts, or None.

        A stop string cannot start in text already returned: a tail that could begin
        one is held back (`_stop_prefix_tail`)."""
        found = [i for i in (self.text.find(s, self._sent) for s in self._stop) if i >= 0]
        return min(found, default=None)

    def _stop_prefix_tail(self) -> int:
        """Length of the longest tail of the unreturned text that is a proper prefix of a stop string."""
        pending = len(self.text) - self._sent
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, pending), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def _stable_context(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` without trailing ids whose decode ends in an incomplete character (a prompt cut
    inside a character would otherwise hold back every output text)."""
    while ids and tokenizer.decode(ids).endswith(REPLACEMENT):
        ids.pop()
    return ids
