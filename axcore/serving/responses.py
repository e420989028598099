"""The engine's outputs as OpenAI response bodies: whole answers, and streamed chunks (server-sent events).

Choice `i` of engine request `k` (the k-th prompt) is the answer's choice `k * n + i`, as
OpenAI numbers a batch of prompts. A choice's text is the engine's `Choice.text` cut by
`text.visible`: before a stop string (a chat reply before its end-of-turn marker) and, while
streaming, without a tail that could still become one. Streams are cumulative outputs turned
into deltas: each chunk holds what a choice gained since its last chunk; its last chunk holds
its `finish_reason`; `data: [DONE]` ends the stream.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from axcore.engine.requests import Choice, RequestOutput
from axcore.serving.text import TextFrontend, visible


@dataclasses.dataclass
class Answer:
    """How one HTTP request's answer is written."""

    # "completion" or "chat".
    kind: str
    # The answer's id ("cmpl-..." or "chatcmpl-...").
    id: str
    # Unix time of creation.
    created: int
    # The model name asked for (the base's when the request named none).
    model: str
    # Choices per prompt.
    n: int
    # Prompts' token ids, by k.
    prompt_ids: list[tuple[int, ...]]
    # Strings a choice's text ends before (the request's stop strings and a chat's end-of-turn marker).
    stops: tuple[str, ...]
    # Top-N log-probabilities per token (0 = the sampled token's only); None = no log-probabilities.
    logprobs: int | None
    # Texts put before each prompt's choices (completions with `echo`), by k; None = none.
    echo: list[str] | None
    # max_tokens 0: the choices hold the prompt only (the engine's one token is dropped).
    score_only: bool
    # Turns token ids into texts.
    frontend: TextFrontend

    def object_name(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def usage(self, finals: Sequence[RequestOutput | None]) -> dict:
        """Token counts: each prompt once, every choice's new tokens."""
        prompt = sum(len(ids) for ids in self.prompt_ids)
        done = 0 if self.score_only else sum(len(c.token_ids) for out in finals if out for c in out.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _tokens(answer: Answer, choice: Choice, start: int, end: int | None = None):
    """`(ids, logprobs, top dicts)` of the choice's new tokens `[start:end]` (lists empty when scoring only)."""
    if answer.score_only:
        return [], [], []
    ids = choice.token_ids[start:end]
    lps = (choice.logprobs or [None] * len(choice.token_ids))[start:end]
    tops = (choice.top_logprobs or [None] * len(choice.token_ids))[start:end]
    return ids, lps, tops


def legacy_logprobs(answer: Answer, ids, lps, tops, offset: int) -> dict:
    """The completions API's logprobs: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
    text offsets counted from `offset`."""
    text = answer.frontend.token_text
    tokens = [text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [None if d is None else {text(t): float(lp) for t, lp in d.items()} for d in tops]
    return {"tokens": tokens, "token_logprobs": [None if lp is None else float(lp) for lp in lps],
            "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(answer: Answer, ids, lps, tops) -> dict:
    """The chat API's logprobs: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""
    text = answer.frontend.token_text

    def entry(token_id, lp):
        token = text(token_id)
        return {"token": token, "logprob": None if lp is None else float(lp), "bytes": list(token.encode("utf-8"))}

    content = []
    for t, lp, top in zip(ids, lps, tops):
        ranked = sorted((top or {}).items(), key=lambda item: -item[1])
        content.append({**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in ranked]})
    return {"content": content}


def _prompt_logprobs(answer: Answer, k: int, output: RequestOutput) -> dict:
    """The echoed prompt's legacy logprobs: each token's log-probability and its position's top-N
    (`RequestOutput.prompt_top_logprobs`; None for the first token, which nothing predicts)."""
    ids = answer.prompt_ids[k]
    lps = output.prompt_logprobs or [None] * len(ids)
    tops = output.prompt_top_logprobs or [None] * len(ids)
    return legacy_logprobs(answer, ids, lps, tops, 0)


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def body(answer: Answer, finals: Sequence[RequestOutput]) -> dict:
    """The whole answer (`stream` false) from each request's finished output."""
    choices = []
    for k, output in enumerate(finals):
        for choice in output.choices:
            ids, lps, tops = _tokens(answer, choice, 0)
            text = "" if answer.score_only else visible(choice.text, answer.stops, True)
            reason = "length" if answer.score_only else (choice.finish_reason or "length")
            item = {"index": k * answer.n + choice.index, "finish_reason": reason}
            if answer.kind == "chat":
                item["message"] = {"role": "assistant", "content": text}
                item["logprobs"] = chat_logprobs(answer, ids, lps, tops) if answer.logprobs is not None else None
            else:
                prefix = answer.echo[k] if answer.echo is not None else ""
                item["text"] = prefix + text
                logprobs = None
                if answer.logprobs is not None:
                    logprobs = legacy_logprobs(answer, ids, lps, tops, len(prefix))
                    if answer.echo is not None:
                        logprobs = _joined(_prompt_logprobs(answer, k, output), logprobs)
                item["logprobs"] = logprobs
            choices.append(item)
    choices.sort(key=lambda c: c["index"])
    return {"id": answer.id, "object": answer.object_name(False), "created": answer.created,
            "model": answer.model, "choices": choices, "usage": answer.usage(finals)}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Deltas:
    """Turns a stream's cumulative outputs into chunks: what each choice gained since its last chunk."""

    def __init__(self, answer: Answer):
        self.answer = answer
        # Per (k, choice index): characters and tokens already sent, whether the choice has finished.
        self.text_sent: dict[tuple[int, int], int] = {}
        self.tokens_sent: dict[tuple[int, int], int] = {}
        self.done: set[tuple[int, int]] = set()
        self.finals: list[RequestOutput | None] = [None] * len(answer.prompt_ids)

    def chunks(self, k: int, output: RequestOutput) -> list[dict]:
        """The chunks `output` (request k's latest) adds, one per choice that gained text, tokens or its end."""
        self.finals[k] = output
        out = []
        for choice in output.choices:
            key = (k, choice.index)
            if key in self.done:
                continue
            finished = choice.finish_reason is not None
            first = key not in self.text_sent
            shown = "" if self.answer.score_only else visible(choice.text, self.answer.stops, finished)
            sent = self.text_sent.get(key, 0)
            text = shown[sent:] if len(shown) > sent else ""
            start = self.tokens_sent.get(key, 0)
            ids, lps, tops = _tokens(self.answer, choice, start)
            if not (first or text or ids or finished):
                continue
            self.text_sent[key] = max(sent, len(shown))
            self.tokens_sent[key] = start + len(ids)
            if finished:
                self.done.add(key)
            reason = ("length" if self.answer.score_only else choice.finish_reason) if finished else None
            out.append(self._chunk(k, choice.index, text, (ids, lps, tops), first, reason, output, sent))
        return out

    def _chunk(self, k, index, text, tokens, first, reason, output, sent) -> dict:
        answer = self.answer
        item: dict = {"index": k * answer.n + index}
        ids, lps, tops = tokens
        if answer.kind == "chat":
            item["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            item["logprobs"] = chat_logprobs(answer, ids, lps, tops) if answer.logprobs is not None else None
        else:
            prefix = answer.echo[k] if (answer.echo is not None and first) else ""
            offset = sent + (len(answer.echo[k]) if answer.echo is not None else 0)
            item["text"] = prefix + text
            logprobs = None
            if answer.logprobs is not None:
                logprobs = legacy_logprobs(answer, ids, lps, tops, offset if not prefix else len(prefix))
                if prefix:
                    logprobs = _joined(_prompt_logprobs(answer, k, output), logprobs)
            item["logprobs"] = logprobs
        item["finish_reason"] = reason
        return {"id": answer.id, "object": answer.object_name(True), "created": answer.created,
                "model": answer.model, "choices": [item]}

    def usage_chunk(self) -> dict:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        answer = self.answer
        return {"id": answer.id, "object": answer.object_name(True), "created": answer.created,
                "model": answer.model, "choices": [], "usage": answer.usage(self.finals)}
