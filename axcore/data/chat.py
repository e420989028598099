"""Chat conversations as documents with loss masks: templates rendered as Hugging Face does.

A chat record is a list of messages `{"role": "system" | "user" | "assistant" | "tool",
"content": str}` (other keys are passed to the template untouched). `render_chat` turns
one record into one document `{"tokens": int32 [n], "loss_mask": uint8 [n]}`, where
`loss_mask[i] == 1` means "train on predicting token i" (the documents' contract in
`axcore/data/schema.py`; `loss_mask[0]` is never used).

How (the exact rules, also in docs/data.md "Chat data and loss masks"):

1. The template is rendered once over the whole conversation (`add_generation_prompt=False`),
   in the environment Hugging Face's `apply_chat_template` uses (a sandboxed jinja2
   environment, `trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`, the
   tokenizer's special tokens as `bos_token`, `eos_token`, ...).
2. The *assistant span* of the assistant message `messages[i]` is what rendering
   `messages[:i + 1]` adds to rendering `messages[:i]` with `add_generation_prompt=True`:
   its content plus whatever the template writes after it (the end marker: `<|eot_id|>`,
   `<|im_end|>`, `</s>`, ...), minus trailing whitespace (the template's line breaks after
   the end marker, which generation never produces since it stops at the marker). The role
   header (the generation prompt) is not in it. Each render must be a prefix of the next
   and of the whole; a template that renders earlier turns differently from the last one
   (one that drops the reasoning of earlier turns, say) is refused with a DataError.
3. The whole text is tokenized once (`Tokenizer.encode_with_offsets(text, document=True)`:
   BOS and EOS exactly as `encode_documents` puts them, from the tokenizer's settings). A
   token the tokenizer adds that the template already wrote (a template that starts with
   `{{ bos_token }}` under `add_bos`) is dropped, so BOS never appears twice.
4. `train_on="assistant"`: a token carries weight iff its character span overlaps an
   assistant span, so the first token of a reply always does, and so does a token that
   straddles a boundary (it produces some of the reply). A token with an empty span
   (tokenizers that trim whitespace from offsets) counts as covering the characters since
   the previous token's end; tokens the tokenizer adds around the text (BOS, EOS) cover no
   character and carry no weight. `train_on="all"`: every token carries weight.

A conversation without an assistant message is refused under "assistant" (a DataError
naming the record: it would train on nothing).

`render_prompt` is the generation side (`axcore generate --chat`): the conversation so far
rendered with `add_generation_prompt=True` and tokenized as a document's start (BOS as the
tokenizer's settings say, never twice, no EOS); `end_of_turn` is the text the template
writes after a reply (`<|eot_id|>`, `<|im_end|>`), where generation stops.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from packaging.version import Version

from axcore.data.errors import DataError
from axcore.data.tokenizer import ByteTokenizer, Tokenizer
from axcore.errors import AxcoreError, ConfigError, one_line

# Oldest jinja2 trusted with templates from model repositories (older ones have sandbox escapes; transformers agrees).
MIN_JINJA2 = "3.1.6"
# Roles a message may have; only "assistant" turns carry weight under train_on="assistant".
ROLES = ("system", "user", "assistant", "tool")

# The template used when neither an explicit file nor the tokenizer gives one: each message
# as `<|role|>\n` + content + `<|end|>\n`; the generation prompt is `<|assistant|>\n`. Plain
# text, so it suits any tokenizer (the bytes tokenizer included); a reply's span is
# `content<|end|>`.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class TrainOn(enum.Enum):
    """Which tokens of a conversation carry weight (`render_chat`'s `train_on`)."""

    # Only the assistant replies (content and end marker), never a system/user/tool token or a role header.
    ASSISTANT = "assistant"
    # Every token.
    ALL = "all"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (Hugging Face's assistant-mask tag) renders its body unchanged.

    Templates written for `return_assistant_tokens_mask` use it; axcore finds assistant spans
    by prefix rendering instead, so the tag only has to parse.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers: jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment of transformers' `apply_chat_template` (same options, globals and filters)."""
    if Version(jinja2.__version__) < Version(MIN_JINJA2):
        raise ConfigError(
            f"chat templates need jinja2>={MIN_JINJA2} (found {jinja2.__version__}, whose sandbox has known escapes); "
            f"run pip install -U jinja2."
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A jinja2 chat template, rendered as Hugging Face's `apply_chat_template` renders it.

    `name` says where the source came from (a file path, "tokenizer_config.json of ...",
    "the built-in default") and appears in every error.

    >>> t = ChatTemplate(DEFAULT_TEMPLATE, name="default")
    >>> t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    '<|user|>\\nHi<|end|>\\n<|assistant|>\\n'
    """

    def __init__(self, source: str, *, name: str = "<string>"):
        if not isinstance(source, str):
            raise DataError(f"chat template {name}: expected the template's jinja2 text, got {type(source).__name__}.")
        # The template's jinja2 text.
        self.source = source
        # Where it came from (errors name it).
        self.name = name
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(
                f"chat template {name}: jinja2 syntax error at template line {e.lineno}: {e.message}; fix the template."
            ) from None

    @property
    def sha256(self) -> str:
        """Hex sha256 of the template text (prepared shards may record it beside the tokenizer's fingerprint)."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, field: str = "chat_template") -> ChatTemplate:
        """The template in the file `path` (`~` expanded); DataError naming `field` and the file when unreadable."""
        full = os.path.expanduser(os.fspath(path))
        try:
            with open(full, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(
                f"{field}: cannot read chat template '{full}' ({e.__class__.__name__}: {e}); "
                f"point it at a UTF-8 jinja2 file."
            ) from None
        return cls(source, name=f"'{full}'")

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Tokenizer,
        override_path: str | os.PathLike | None = None,
        *,
        path: str | os.PathLike | None = None,
        field: str = "chat_template",
    ) -> ChatTemplate:
        """The template for `tokenizer`: an explicit file, else `tokenizer.chat_template`, else `DEFAULT_TEMPLATE`.

        `path` is another name for `override_path`; `field` is the config path errors name.
        """
        explicit = override_path if override_path is not None else path
        if explicit is not None:
            return cls.from_file(explicit, field=field)
        source = tokenizer.chat_template
        if source is not None:
            return cls(source, name=f"of the tokenizer ({type(tokenizer).__name__})")
        return cls(DEFAULT_TEMPLATE, name="(axcore's built-in default)")

    @staticmethod
    def other_than_tokenizers(tokenizer: Tokenizer, override_path: str | os.PathLike | None, *, field: str) -> str | None:
        """A warning when `for_tokenizer(tokenizer, override_path)` is not the tokenizer's own template, else None.

        Two cases: an explicit file whose text differs from the template the tokenizer has, and a
        tokenizer that has none, so the built-in default would be used (never said of the bytes
        tokenizer, which cannot have one and whose chats the default is written for). `field` is the
        config path of the explicit file. Unreadable files and templates give None (using them fails).
        """
        try:
            own = tokenizer.chat_template
            explicit = None if override_path is None else ChatTemplate.from_file(override_path, field=field).source
        except AxcoreError:
            return None
        kind = type(tokenizer).__name__
        if explicit is not None:
            if own is None or explicit == own:
                return None
            return (f"{field}: the chats are rendered with '{override_path}', not the chat template of the tokenizer "
                    f"({kind}); the model learns that format. Unset {field} to train on the tokenizer's own.")
        if own is not None or isinstance(tokenizer, ByteTokenizer):
            return None
        return (f"{field}: the tokenizer ({kind}) has no chat template, so the chats are rendered with axcore's built-in "
                f"default (<|role|> ... <|end|>), a format the model has not seen; set {field} to the model's template "
                f"file (chat_template.jinja) if it has one.")

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False, **variables: Any) -> str:
        """The template's text for `messages` (`bos_token`, `eos_token`, ... given as `variables`).

        Raises:
            jinja2.TemplateError: the template raised (`raise_exception`) or failed (`render_chat`
                turns it, and the Python errors a template can raise, into a DataError).
        """
        context = {"tools": None, "documents": None, **variables}
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **context)


def _check_messages(messages: Any, where: str) -> None:
    """DataError naming `where` for anything but a non-empty list of {"role": known, "content": str} dicts."""
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: a chat record must be a non-empty list of messages, got {_describe(messages)}; "
            f"give [{{\"role\": ..., \"content\": ...}}, ...]."
        )
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: message {k} is {_describe(message)}, not an object; "
                f"give {{\"role\": ..., \"content\": ...}}."
            )
        role = message.get("role")
        if role not in ROLES:
            what = "has no \"role\"" if "role" not in message else f"has unknown role {role!r}"
            raise DataError(f"{where}: message {k} {what}; use one of {', '.join(ROLES)}.")
        if "content" not in message:
            raise DataError(f"{where}: message {k} ({role}) has no \"content\"; give its text as a string.")
        if not isinstance(message["content"], str):
            raise DataError(
                f"{where}: message {k} ({role}) has content of type {type(message['content']).__name__}; "
                f"give its text as a string (content lists/parts are not supported)."
            )


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


# What rendering a template can raise on bad data (jinja's errors, and Python's from expressions like `"a" + 1`).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def _render(template: ChatTemplate, messages: Sequence[dict], prompt: bool, variables: dict, where: str) -> str:
    try:
        return template.render(messages, add_generation_prompt=prompt, **variables)
    except _RENDER_ERRORS as e:
        raise DataError(
            f"{where}: chat template {template.name} failed on this conversation: {one_line(e)}; "
            f"fix the record or use another template."
        ) from None


def assistant_spans(
    messages: Sequence[dict], template: ChatTemplate, variables: dict, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span `[start, end)` of each assistant reply (module docstring, 2)."""
    full = _render(template, messages, False, variables, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(template, messages[:i], True, variables, where)
        after = _render(template, messages[: i + 1], False, variables, where)
        if not after.startswith(before) or not full.startswith(after):
            raise DataError(
                f"{where}: chat template {template.name} does not render message {i} (assistant) as a continuation "
                f"of the messages before it (rendering a prefix of the conversation is not a prefix of rendering "
                f"the whole), so its reply cannot be located; use a template whose renders extend each other "
                f"(the chat source's template setting) or train_on: all."
            )
        start = len(before)
        spans.append((start, max(start, len(after.rstrip()))))
    return full, spans


def _token_spans(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Character spans `[start, end)` per token `[n]`, an empty raw span widened back to the previous token's end."""
    starts = offsets[:, 0].astype(np.int64)
    ends = offsets[:, 1].astype(np.int64)
    previous_end = np.concatenate([[0], np.maximum.accumulate(ends)[:-1]]) if len(ends) else ends
    empty = ends <= starts
    return np.where(empty, np.minimum(previous_end, ends), starts), ends


def render_chat(
    messages: list[dict],
    tokenizer: Tokenizer,
    template: ChatTemplate,
    *,
    train_on: str | TrainOn = "assistant",
    where: str,
) -> dict:
    """One conversation -> `{"tokens": int32 [n], "loss_mask": uint8 [n]}` (module docstring for the rules).

    Args:
        messages: the conversation, `[{"role": ..., "content": str}, ...]`.
        tokenizer: encodes the rendered text (`encode_with_offsets`) and gives the special tokens.
        template: the chat template (`ChatTemplate.for_tokenizer`).
        train_on: "assistant" (replies only) or "all" (`TrainOn`).
        where: the record's location for errors, e.g. "'chat.jsonl' line 17".

    Raises:
        DataError: a malformed message (unknown role, missing or non-string content), no
            assistant message under train_on="assistant", a template that fails or does
            not render prefixes as prefixes; naming `where`.
    """
    mode = TrainOn(train_on)
    _check_messages(messages, where)
    if mode is TrainOn.ASSISTANT and not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where}: the conversation has no assistant message, so under train_on: assistant nothing in it "
            f"trains; add the reply, drop the record, or use train_on: all."
        )
    variables = dict(tokenizer.special_tokens)
    if mode is TrainOn.ASSISTANT:
        text, spans = assistant_spans(messages, template, variables, where)
    else:
        text, spans = _render(template, messages, False, variables, where), []
    ids, offsets = tokenizer.encode_with_offsets(text, document=True)
    ids = np.asarray(ids, np.int32).reshape(-1)
    offsets = np.asarray(offsets, np.int64).reshape(-1, 2)
    ids, offsets = _drop_repeated_specials(ids, offsets, tokenizer)
    if mode is TrainOn.ALL:
        return {"tokens": ids, "loss_mask": np.ones(len(ids), np.uint8)}
    starts, ends = _token_spans(offsets)
    mask = np.zeros(len(ids), bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo) & (ends > starts)
    return {"tokens": ids, "loss_mask": mask.astype(np.uint8)}


def _drop_repeated_specials(
    ids: np.ndarray, offsets: np.ndarray, tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """Drop an added BOS (EOS) that the template also wrote at the text's start (end): BOS never twice."""
    n = len(ids)
    first, last = 0, n
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    if bos is not None and n >= 2 and ids[0] == ids[1] == bos and offsets[0, 1] <= offsets[0, 0]:
        first = 1
    if eos is not None and n - first >= 2 and ids[-1] == ids[-2] == eos and offsets[-1, 1] <= offsets[-1, 0]:
        last = n - 1
    return ids[first:last], offsets[first:last]


# Reply text `end_of_turn` renders to find what the template writes after a reply.
_PROBE = "axcore_probe_reply"


def render_prompt(
    messages: list[dict], tokenizer: Tokenizer, template: ChatTemplate, *, where: str
) -> tuple[str, np.ndarray]:
    """The conversation so far as a generation prompt: `(text, int32 ids [n])`.

    `text` is `template.render(messages, add_generation_prompt=True)` with the tokenizer's
    special tokens (what transformers' `apply_chat_template(..., add_generation_prompt=True,
    tokenize=False)` returns); the ids are `tokenizer.encode_with_offsets(text)` (BOS first
    under `add_bos`), a BOS the template also wrote dropped, as in `render_chat`.

    Raises:
        DataError: a malformed message or a template that fails, naming `where`.
    """
    _check_messages(messages, where)
    text = _render(template, messages, True, dict(tokenizer.special_tokens), where)
    ids, offsets = tokenizer.encode_with_offsets(text)
    ids = np.asarray(ids, np.int32).reshape(-1)
    ids, _ = _drop_repeated_specials(ids, np.asarray(offsets, np.int64).reshape(-1, 2), tokenizer)
    return text, ids


def end_of_turn(template: ChatTemplate, tokenizer: Tokenizer) -> str:
    """The text `template` writes right after an assistant reply (its end marker), "" if none.

    Found by rendering a probe conversation (a user message, then a probe reply) without a
    generation prompt: what follows the probe reply, minus trailing whitespace (as an
    assistant span ends, module docstring, 2), e.g. `<|eot_id|>`, `<|im_end|>`, `</s>`, `<|end|>`.

    Raises:
        DataError: the template fails on the probe conversation.
    """
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    text = _render(template, messages, False, dict(tokenizer.special_tokens), "the end-of-turn probe")
    return text.split(_PROBE, 1)[1].rstrip() if _PROBE in text else ""
