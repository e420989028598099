"""The OpenAI HTTP API's request bodies (pydantic models) and error bodies, and their mapping to `SamplingParams`.

Field types are checked by pydantic (a wrong type is a 400 naming the field); value ranges
are checked once, by `SamplingParams` itself, and its `SamplingParamsError` is turned into
the same 400 with the field's name as the request spells it (`top_logprobs` in a chat
request is the engine's `logprobs`). Fields OpenAI defines that this server does not
implement (`suffix`, `best_of` > `n`, `logit_bias`, tools, JSON mode) are refused by name
rather than ignored; fields it does not know are ignored, as OpenAI's server ignores them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from axcore.engine.requests import SamplingParams, SamplingParamsError
from axcore.errors import AxcoreError


class RequestError(AxcoreError):
    """A request the server refuses: its HTTP `status`, the `param` it names (None: the whole request),
    and OpenAI's error `type` and `code`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


def error_body(error: RequestError) -> dict:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk before `[DONE]` carries the usage."""

    model_config = ConfigDict(extra="ignore")
    # Send a last chunk with `usage` and no choices.
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat requests share: the model, sampling, stopping, streaming."""

    model_config = ConfigDict(extra="ignore")
    # The base model's or an adapter's name (`/v1/models`); None = the base model.
    model: str | None = None
    # Choices per prompt.
    n: int | None = None
    # Softmax temperature; 0 = greedy; None = 1.
    temperature: float | None = None
    # Nucleus mass; None = 1 (all tokens).
    top_p: float | None = None
    # The k most likely tokens; 0 or -1 = all.
    top_k: int | None = None
    # Drop tokens below min_p times the most likely one's probability.
    min_p: float | None = None
    # OpenAI's presence and frequency penalties, in [-2, 2].
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Logits of tokens already seen divided (> 0) or multiplied (< 0) by this; 1 = off.
    repetition_penalty: float | None = None
    # Seed of this request's draws.
    seed: int | None = None
    # A stop string or up to four (the text ends before it).
    stop: str | list[str] | None = None
    # Token ids that end a choice (kept in the output).
    stop_token_ids: list[int] | None = None
    # Keep generating past the end-of-sequence token.
    ignore_eos: bool = False
    # Answer with server-sent events.
    stream: bool = False
    # Streaming options (usage in a last chunk).
    stream_options: StreamOptions | None = None
    # OpenAI's end-user id: accepted, unused.
    user: str | None = None
    # Refused unless empty: per-token logit biases are not implemented.
    logit_bias: dict[str, float] | None = None

    def refuse_unimplemented(self) -> None:
        """RequestError naming the first OpenAI field this server does not implement that the request sets."""
        if self.logit_bias:
            raise RequestError("'logit_bias' is not supported by this server; remove it.", param="logit_bias")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise RequestError(f"'stop' takes at most 4 sequences, got {len(self.stop)}.", param="stop")


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    # A string, a list of token ids, or a list of either (one completion per prompt).
    prompt: str | list[int] | list[str] | list[list[int]]
    # New tokens per choice; 0 (with `echo`) scores the prompt only.
    max_tokens: int | None = 16
    # Log-probabilities of the sampled token and of the top-N (0..20) at each step.
    logprobs: int | None = None
    # Put the prompt before the completion (with its log-probabilities if `logprobs`).
    echo: bool = False
    # Must be None or equal to `n` (this server does not rank extra choices).
    best_of: int | None = None
    # Not supported (no insertion); must be None.
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids (at least one)."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise RequestError("'prompt' is empty; give a string or a list of token ids.", param="prompt")
        return list(p)

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.suffix:
            raise RequestError("'suffix' is not supported by this server; remove it.", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError("'best_of' must equal 'n' (ranking extra choices is not supported).", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("'max_tokens' 0 only scores the prompt and needs 'echo': true.", param="max_tokens")


class TextPart(BaseModel):
    """One part of a message's content: only text."""

    model_config = ConfigDict(extra="ignore")
    # Only "text" parts are supported.
    type: Literal["text"]
    # The part's text.
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore")
    # "system", "user", "assistant" (the template decides which it accepts).
    role: str
    # The message's text, or its text parts (joined).
    content: str | list[TextPart] | None = None
    # The author's name, passed to the template.
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it: `{"role", "content"[, "name"]}`."""
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(
            part.text for part in self.content
        )
        message = {"role": self.role, "content": content or ""}
        return {**message, "name": self.name} if self.name is not None else message


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    # The conversation; rendered with the model's chat template and a generation prompt.
    messages: list[ChatMessage]
    # New tokens per choice; None = the server's --default-max-tokens.
    max_tokens: int | None = None
    # OpenAI's newer name for max_tokens (wins when both are given).
    max_completion_tokens: int | None = None
    # Log-probabilities of each sampled token.
    logprobs: bool = False
    # And of the top-N tokens at each step (0..20; needs `logprobs`).
    top_logprobs: int | None = None
    # Refused when set: tool calls are not supported.
    tools: list[Any] | None = None
    # Refused unless "none": tool calls are not supported.
    tool_choice: Any = None
    # Refused unless {"type": "text"}: JSON mode is not supported.
    response_format: dict[str, Any] | None = None

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if not self.messages:
            raise RequestError("'messages' is empty; give at least one message.", param="messages")
        if self.tools:
            raise RequestError("'tools' is not supported by this server; remove it.", param="tools")
        if self.tool_choice not in (None, "none"):
            raise RequestError("'tool_choice' is not supported by this server; remove it.", param="tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise RequestError("'response_format' other than text is not supported.", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")


def sampling_params(
    request: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    renamed: dict[str, str] | None = None,
    extra_stop: tuple[str, ...] = (),
    extra_stop_ids: tuple[int, ...] = (),
) -> SamplingParams:
    """The engine's `SamplingParams` for `request` (None fields take OpenAI's defaults).

    Raises:
        RequestError: a value out of range, `param` naming the field as the request spells it
            (`renamed` maps the engine's field names to the request's, e.g. logprobs -> top_logprobs).
    """
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])

    def given(value, default):
        return default if value is None else value

    top_k = given(request.top_k, 0)
    try:
        return SamplingParams(
            n=given(request.n, 1), max_tokens=max_tokens, temperature=given(request.temperature, 1.0),
            top_k=0 if top_k == -1 else top_k,
            top_p=given(request.top_p, 1.0), min_p=given(request.min_p, 0.0),
            presence_penalty=given(request.presence_penalty, 0.0),
            frequency_penalty=given(request.frequency_penalty, 0.0),
            repetition_penalty=given(request.repetition_penalty, 1.0), seed=request.seed,
            stop=(*stop, *extra_stop), stop_token_ids=(*(request.stop_token_ids or ()), *extra_stop_ids),
            ignore_eos=request.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
    except SamplingParamsError as e:
        field = (renamed or {}).get(e.field, e.field)
        raise RequestError(f"'{field}': {e.problem}", param=field) from None


def validation_error(errors: list[dict]) -> RequestError:
    """The 400 of pydantic's first error: the field's dotted path (without "body") and what is wrong with it."""
    first = errors[0] if errors else {"loc": (), "msg": "malformed request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _union_tag(part)]
    if first.get("type") == "json_invalid":
        return RequestError(f"The request body is not valid JSON: {first.get('msg')}.", param=None)
    param = ".".join(loc) or None
    where = f"'{param}': " if param else "The request body: "
    return RequestError(f"{where}{first.get('msg', 'invalid value')}.", param=param)


# The names pydantic puts in an error's location for the member of a union that failed (`str`, `list[int]`, a model).
_SCALAR_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _union_tag(part) -> bool:
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or part[:1].isupper())
