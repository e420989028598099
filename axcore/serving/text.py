"""Text in and out of the server: prompts to token ids, chat messages through the chat template, tokens' texts.

`TextFrontend` holds what the engine does not: the tokenizer the prompts are encoded with
(the model's own), and the chat template with its end-of-turn marker. A chat request's
prompt is `axcore.data.chat.render_prompt` (what `axcore generate --chat` feeds, the string
transformers' `apply_chat_template(..., add_generation_prompt=True)` gives); its reply stops
at the marker (a stop string, and a stop token when the marker is one token) and never
shows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from axcore.data.chat import ChatTemplate, end_of_turn, render_prompt
from axcore.data.tokenizer import Tokenizer
from axcore.errors import AxcoreError
from axcore.serving.protocol import RequestError


@dataclasses.dataclass
class ChatPrompt:
    """A rendered conversation: its text, its token ids, and how the reply ends."""

    # The rendered prompt (generation prompt included).
    text: str
    # Its token ids `[n]`.
    token_ids: tuple[int, ...]
    # The end-of-turn marker ("" if the template has none): a stop string the reply never shows.
    marker: str
    # The marker's token id when it is one token, else ().
    marker_ids: tuple[int, ...]


class TextFrontend:
    """Encodes prompts and renders chats with `tokenizer` (and `chat_template`, None = chats refused).

    Args:
        tokenizer: the model's tokenizer (`encode(text) -> int ids [n]`, `decode(ids) -> str`,
            `encode_with_offsets` for chats).
        chat_template: the run's template; None answers chat requests with a 400.
        vocab_size: token ids a prompt may hold are `0..vocab_size - 1` (default: the tokenizer's).
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None = None, *,
                 vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = int(vocab_size if vocab_size is not None else tokenizer.vocab_size)
        self.marker = end_of_turn(chat_template, tokenizer) if chat_template is not None else ""
        self.marker_ids = tuple(_one_token(tokenizer, self.marker))

    def encode(self, prompt: str | Sequence[int], *, param: str = "prompt") -> tuple[int, ...]:
        """A prompt's token ids; RequestError naming `param` when it is empty or an id is outside the vocabulary."""
        if isinstance(prompt, str):
            ids = tuple(int(t) for t in np.asarray(self.tokenizer.encode(prompt)).reshape(-1))
        else:
            ids = tuple(int(t) for t in prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"'{param}': token id {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}.", param=param
                )
        if not ids:
            raise RequestError(f"'{param}' encodes to no tokens; give a non-empty prompt.", param=param)
        return ids

    def render(self, messages: list[dict]) -> ChatPrompt:
        """The conversation as a generation prompt; RequestError (param "messages") if the template refuses it."""
        if self.chat_template is None:
            raise RequestError(
                "This model has no chat template (the run was not trained on chat data and its tokenizer ships "
                "none); restart the server with --chat-template FILE, or use /v1/completions.", param="messages",
            )
        try:
            text, ids = render_prompt(messages, self.tokenizer, self.chat_template, where="messages")
        except AxcoreError as e:
            raise RequestError(str(e), param="messages") from None
        if len(ids) == 0:
            raise RequestError("'messages' render to no tokens.", param="messages")
        return ChatPrompt(text, tuple(int(t) for t in ids), self.marker, self.marker_ids)

    def token_text(self, token_id: int) -> str:
        """One token's text (as its own decode gives it)."""
        return self.text([token_id])

    def text(self, ids: Sequence[int]) -> str:
        """The decode of `ids`; ids past the tokenizer's vocabulary (a model's padded embedding rows) have no text."""
        known = self.tokenizer.vocab_size
        return self.tokenizer.decode([int(t) for t in ids if 0 <= int(t) < known])


def _one_token(tokenizer: Tokenizer, marker: str) -> list[int]:
    """The marker's token id when it encodes to exactly one token of its own text, else []."""
    if not marker:
        return []
    ids, offsets = tokenizer.encode_with_offsets(marker)
    offsets = np.asarray(offsets).reshape(-1, 2)
    own = [int(i) for i, (a, b) in zip(np.asarray(ids).reshape(-1), offsets) if b > a]
    return own if len(own) == 1 else []


def visible(text: str, stops: Sequence[str], finished: bool) -> str:
    """The part of a choice's `text` a client may see now: cut before the first stop string, and while the
    choice runs, without a tail that could still become a stop string (a stream never shows one in part)."""
    cut = len(text)
    for stop in stops:
        at = text.find(stop)
        if at >= 0:
            cut = min(cut, at)
    text = text[:cut]
    if finished:
        return text
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[: len(text) - hold]
