"""What a caller asks the engine for and what it gets back (plain data, no JAX).

`SamplingParams` validates itself: a bad field raises `SamplingParamsError` naming the
field (the server answers it with a 400 whose `param` is that field). Outputs are
cumulative: every `RequestOutput` of a request holds all its choices' tokens so far, so
a stream's consumer takes the suffix it has not seen.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from axcore.errors import AxcoreError


class SamplingParamsError(AxcoreError, ValueError):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"'{field}': {problem}")
        self.field, self.problem = field, problem


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its choices stop (OpenAI's meanings)."""

    # Choices generated from the one prompt (they share its KV blocks).
    n: int = 1
    # New tokens per choice at most.
    max_tokens: int = 16
    # Softmax temperature; 0 = greedy (the most likely token, ties to the lowest id).
    temperature: float = 1.0
    # Keep the k most likely tokens; 0 = all.
    top_k: int = 0
    # Keep the smallest most-likely set whose probability reaches top_p; 1.0 = all.
    top_p: float = 1.0
    # Drop tokens whose probability is below min_p times the most likely one's; 0 = none.
    min_p: float = 0.0
    # Subtracted from the logit of every token already generated (OpenAI presence penalty).
    presence_penalty: float = 0.0
    # Subtracted from a token's logit once per time it was generated (OpenAI frequency penalty).
    frequency_penalty: float = 0.0
    # Logits of tokens in the prompt or output divided (if > 0) or multiplied (if < 0) by this; 1.0 = off.
    repetition_penalty: float = 1.0
    # Seed of this request's draws (the same seed gives the same tokens in any batch); None = engine's.
    seed: int | None = None
    # Strings that end a choice; the text stops before the string.
    stop: tuple[str, ...] = ()
    # Token ids that end a choice; the token is part of the output.
    stop_token_ids: tuple[int, ...] = ()
    # Keep generating past the tokenizer's end-of-sequence token.
    ignore_eos: bool = False
    # Log-probabilities of the sampled token and of the top-N tokens per step; None = none.
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (and their top-N); None = none.
    prompt_logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _at_least("n", self.n, 1)
        _at_least("max_tokens", self.max_tokens, 1)
        _at_least("top_k", self.top_k, 0)
        _finite_in("temperature", self.temperature, 0.0, math.inf)
        _finite_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _finite_in("min_p", self.min_p, 0.0, 1.0)
        _finite_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _finite_in("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingParamsError("seed", f"must be an integer or null, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop", "every stop sequence must be a non-empty string")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _at_least(name, value, 0)
                if value > 20:
                    raise SamplingParamsError(name, f"at most 20 top log-probabilities, got {value}")

    @property
    def greedy(self) -> bool:
        """Whether every token is the most likely one (no draw)."""
        return self.temperature == 0


def _at_least(field: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SamplingParamsError(field, f"must be an integer >= {low}, got {value!r}")


def _finite_in(field: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {f'{high}]' if math.isfinite(high) else 'inf)'}"
        raise SamplingParamsError(field, f"must be a number in {bounds}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One request: a tokenized prompt, how to sample, and which adapter (None = the base model)."""

    # Unique among the engine's live requests.
    request_id: str
    # The prompt's token ids (at least one).
    prompt_token_ids: tuple[int, ...]
    # Sampling and stopping.
    params: SamplingParams = SamplingParams()
    # Name of a resident LoRA adapter; None = the base model.
    adapter: str | None = None
    # When it arrived (time.monotonic()); requests are served first come, first served.
    arrival: float = dataclasses.field(default_factory=time.monotonic)

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise SamplingParamsError("prompt", "the prompt must hold at least one token")


@dataclasses.dataclass
class Choice:
    """One of a request's `n` continuations, so far."""

    # Its index among the request's choices.
    index: int
    # Every new token so far (a stop token included; tokens of a stop string excluded once matched).
    token_ids: list[int] = dataclasses.field(default_factory=list)
    # Their text (empty where the engine has no tokenizer); ends before a matched stop string.
    text: str = ""
    # Log-probability of each new token under the sampling distribution's logits; None unless asked.
    logprobs: list[float] | None = None
    # Per new token, {token id: log-probability} of the top-N tokens; None unless asked.
    top_logprobs: list[dict[int, float]] | None = None
    # "stop" (stop token or string), "length" (max_tokens or the context), "abort"; None while running.
    finish_reason: str | None = None


@dataclasses.dataclass
class RequestOutput:
    """A request's state after an engine step (cumulative: all tokens so far)."""

    # The request's id.
    request_id: str
    # Its prompt's token ids.
    prompt_token_ids: tuple[int, ...]
    # The choices, by index.
    choices: list[Choice]
    # Log-probability of each prompt token given those before it (None for the first); None unless asked.
    prompt_logprobs: list[float | None] | None = None
    # Whether every choice has finished.
    finished: bool = False
    # Per prompt token, {token id: log-probability} of the `prompt_logprobs` most likely tokens at its
    # position (None for the first); None unless asked.
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of a running engine (what `/metrics` exports)."""

    # Requests waiting to start.
    waiting: int
    # Sequences in the running batch.
    running: int
    # KV-cache blocks holding a live sequence's tokens, and blocks free (cached-but-unused ones count as free).
    kv_blocks_used: int
    kv_blocks_free: int
    # Prompt blocks looked up in the prefix cache, and how many were found (since start).
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Prompt tokens computed and tokens generated (since start).
    prompt_tokens: int
    generation_tokens: int
    # Sequences preempted (their blocks freed, recomputed later) since start.
    preemptions: int
    # Compiled programs (shape buckets) so far, and the cap.
    compiled_programs: int
    compiled_programs_cap: int


class EngineClient(Protocol):
    """What a server needs from an engine (`axcore.engine.Engine` provides it)."""

    def model_names(self) -> Sequence[str]:
        """The base model's name first, then each resident adapter's."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of `request` after each step that changed it, the last one `finished`.
        Closing the iterator early (a client gone) aborts the request and frees its blocks."""

    def stats(self) -> EngineStats:
        """The current counters."""
