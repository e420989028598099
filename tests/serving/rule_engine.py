"""A test EngineClient that generates real tokens by a fixed rule, and a live server in a thread.

`RuleEngine`: choice `i` of a request for adapter `a` continues its last token `t` with
`rule(t, i, a) = (t + 1 + i + OFFSETS[a]) % VOCAB`; the sampled token has probability 1/2 and
every other token `1 / (2 (VOCAB - 1))`, so log-probabilities and top-N lists are known in
closed form. Text is the ByteTokenizer's decoding of the tokens (ids < 128: ASCII). It honours
`max_tokens`, `n`, `stop` (the text ends before the string, finish "stop"), `stop_token_ids`,
`logprobs` and `prompt_logprobs` (with their top-N), takes `step_s` seconds per step, counts what `stats()`
reports, and records every request it was asked for, finished and aborted (the stream
closed or cancelled before the end). `hold` (a threading.Event) keeps every request waiting
until it is set.

`LiveServer`: the real app under uvicorn on 127.0.0.1, a free port, in a thread.
"""

from __future__ import annotations

import asyncio
import math
import threading

import live_server

from axcore.data.tokenizer import ByteTokenizer
from axcore.engine.requests import Choice, EngineStats, GenerationRequest, RequestOutput
from axcore.serving import ServerSettings, TextFrontend

VOCAB = 128
BASE, ADAPTER = "tiny", "tiny-lora"
OFFSETS = {None: 0, ADAPTER: 1}
LOG_HALF = math.log(0.5)
LOG_REST = math.log(0.5 / (VOCAB - 1))


def rule(last: int, index: int, adapter: str | None) -> int:
    """The token after `last` in choice `index` of a request for `adapter`."""
    return (last + 1 + index + OFFSETS[adapter]) % VOCAB


def top(last: int, index: int, adapter: str | None, count: int) -> dict[int, float]:
    """The top-`count` tokens after `last`: the rule's token, then the lowest other ids."""
    chosen = rule(last, index, adapter)
    others = [t for t in range(VOCAB) if t != chosen][: max(count - 1, 0)]
    return {chosen: LOG_HALF, **{t: LOG_REST for t in others}} if count else {}


class RuleEngine:
    """An EngineClient generating by `rule` (see the module docstring)."""

    def __init__(self, step_s: float = 0.0, hold: threading.Event | None = None, block_size: int = 4,
                 num_blocks: int = 4096):
        self.step_s, self.hold = step_s, hold
        self.block_size, self.num_blocks = block_size, num_blocks
        self.tokenizer = ByteTokenizer()
        self.requests: dict[str, GenerationRequest] = {}
        self.live: dict[str, int] = {}  # Live request id -> KV blocks it holds.
        self.waiting = 0
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def model_names(self):
        return [BASE, ADAPTER]

    def stats(self) -> EngineStats:
        used = sum(self.live.values())
        running = sum(self.requests[r].params.n for r, blocks in self.live.items() if blocks)
        return EngineStats(self.waiting, running, used, self.num_blocks - used, 0, 0, self.prompt_tokens,
                           self.generation_tokens, 0, 1, 8)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    async def stream(self, request: GenerationRequest):
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.live[request.request_id] = 0
        self.waiting += 1
        held, done = True, False
        try:
            while self.hold is not None and not self.hold.is_set():
                await asyncio.sleep(0.005)
            held = False
            self.waiting -= 1
            async for output in self._generate(request):
                yield output
            done = True
        finally:
            self.waiting -= held  # Closed while held.
            self.live.pop(request.request_id, None)
            (self.finished if done else self.aborted).append(request.request_id)

    async def _generate(self, request: GenerationRequest):
        p, prompt = request.params, list(request.prompt_token_ids)
        self.prompt_tokens += len(prompt)
        choices = [Choice(i, logprobs=[] if p.logprobs is not None else None,
                          top_logprobs=[] if p.logprobs is not None else None) for i in range(p.n)]
        tokens = [[] for _ in choices]
        prompt_lps = prompt_tops = None
        if p.prompt_logprobs is not None:
            prompt_lps = [None] + [LOG_HALF if b == rule(a, 0, request.adapter) else LOG_REST
                                   for a, b in zip(prompt, prompt[1:])]
            prompt_tops = [None] + [top(a, 0, request.adapter, p.prompt_logprobs) for a in prompt[:-1]]
        for _ in range(p.max_tokens):
            await asyncio.sleep(self.step_s)
            for choice, own in zip(choices, tokens):
                if choice.finish_reason is None:
                    self._step(request, choice, own, prompt)
            self.live[request.request_id] = p.n * self._blocks(len(prompt) + max(len(t) for t in tokens))
            finished = all(c.finish_reason is not None for c in choices)
            yield RequestOutput(request.request_id, request.prompt_token_ids,
                                [_copy(c) for c in choices], prompt_lps, finished, prompt_tops)
            if finished:
                return

    def _step(self, request: GenerationRequest, choice: Choice, own: list[int], prompt: list[int]) -> None:
        p = request.params
        last = (own or prompt)[-1]
        token = rule(last, choice.index, request.adapter)
        own.append(token)
        self.generation_tokens += 1
        choice.token_ids.append(token)
        if p.logprobs is not None:
            choice.logprobs.append(LOG_HALF)
            choice.top_logprobs.append(top(last, choice.index, request.adapter, p.logprobs))
        text = self.tokenizer.decode([t for t in choice.token_ids if t not in p.stop_token_ids])
        cut = min((text.find(s) for s in p.stop if s in text), default=-1)
        choice.text = text if cut < 0 else text[:cut]
        if cut >= 0 or token in p.stop_token_ids:
            choice.finish_reason = "stop"
        elif len(choice.token_ids) == p.max_tokens:
            choice.finish_reason = "length"


def _copy(choice: Choice) -> Choice:
    return Choice(choice.index, list(choice.token_ids), choice.text,
                  None if choice.logprobs is None else list(choice.logprobs),
                  None if choice.top_logprobs is None else list(choice.top_logprobs), choice.finish_reason)


def expected(prompt: str, max_tokens: int, index: int = 0, adapter: str | None = None, stop: str | None = None):
    """`(text, finish_reason)` the rule gives for a text prompt, computed on its own (no engine)."""
    last, out = ord(prompt[-1]), []
    for _ in range(max_tokens):
        last = (last + 1 + index + OFFSETS[adapter]) % VOCAB
        out.append(chr(last))
        text = "".join(out)
        if stop is not None and stop in text:
            return text[: text.index(stop)], "stop"
    return "".join(out), "length"


class LiveServer(live_server.LiveServer):
    """The app over `engine` (a byte-level frontend of VOCAB ids) under uvicorn on 127.0.0.1 in a thread."""

    def __init__(self, engine, settings: ServerSettings | None = None, chat_template=None):
        super().__init__(engine, TextFrontend(ByteTokenizer(), chat_template, vocab_size=VOCAB), settings)
