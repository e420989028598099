"""A live request's outputs as the engine builds them: choices, text, log-probabilities (host side, no JAX).

`RequestState` holds one request's cumulative `RequestOutput` while it runs. The engine
feeds it each step's sampled tokens (`add_token`); it detokenizes every choice
incrementally (`IncrementalDetokenizer`), matches stop strings, and cuts a choice's
tokens and log-probabilities back to the tokens kept when a stop string matched.

Text rules (a choice's `text`): the tokens before a stop token (a `stop_token_ids` or
end-of-sequence token that ended the choice) are decoded; the stop token is kept in
`token_ids` but not decoded. A matched stop string ends the text before it and drops the
tokens that produced it. With no tokenizer, text stays "" and stop strings are refused
when the request is added.
"""

from __future__ import annotations

from collections.abc import Callable

from axcore.data.tokenizer import Tokenizer
from axcore.engine.detokenize import IncrementalDetokenizer
from axcore.engine.requests import Choice, GenerationRequest, RequestOutput


class RequestState:
    """One live request's outputs so far, and where they go.

    Args:
        request: the request.
        index: its arrival rank in the engine (seeds its draws when it has no seed).
        tokenizer: the engine's tokenizer, or None (no text).
        sink: called with each new `RequestOutput` (and with an exception if the engine fails);
            None = nobody listens (`Engine.generate` reads `output`).
    """

    def __init__(self, request: GenerationRequest, index: int, tokenizer: Tokenizer | None,
                 sink: Callable[[RequestOutput | BaseException], None] | None = None):
        self.request, self.index, self.sink = request, index, sink
        params = request.params
        asked = params.logprobs is not None
        self.choices = [Choice(i, logprobs=[] if asked else None, top_logprobs=[] if asked else None)
                        for i in range(params.n)]
        self.detokenizers = [None if tokenizer is None else
                             IncrementalDetokenizer(tokenizer, params.stop, request.prompt_token_ids)
                             for _ in range(params.n)]
        # Log-probability of each prompt token given those before it (index 0: None); None unless asked.
        self.prompt_logprobs: list[float | None] | None = (
            [None] * len(request.prompt_token_ids) if params.prompt_logprobs is not None else None)
        # Per prompt token, its position's top `prompt_logprobs` tokens {id: log-probability} (index 0: None).
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = (
            None if self.prompt_logprobs is None else list(self.prompt_logprobs))
        # The latest output (None until the first token).
        self.output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        """Whether every choice has a finish reason."""
        return all(choice.finish_reason is not None for choice in self.choices)

    def add_token(self, index: int, token: int, reason: str | None, logprob: float | None = None,
                  top: dict[int, float] | None = None) -> bool:
        """Appends `token` to choice `index` (with its log-probabilities when asked); `reason` ends it.

        Returns True when a stop string matched (the caller ends the sequence with "stop").
        """
        choice = self.choices[index]
        choice.token_ids.append(int(token))
        if choice.logprobs is not None:
            choice.logprobs.append(float(logprob))
            choice.top_logprobs.append(dict(top or {}))
        detokenizer = self.detokenizers[index]
        stop_token = reason == "stop"  # finish_step ends on a token only for a stop or end-of-sequence token.
        if detokenizer is not None:
            detokenizer.update([] if stop_token else [token], final=reason is not None)
            choice.text = detokenizer.text
            if detokenizer.stopped:
                kept = detokenizer.kept_tokens
                del choice.token_ids[kept:]
                if choice.logprobs is not None:
                    del choice.logprobs[kept:], choice.top_logprobs[kept:]
                choice.finish_reason = "stop"
                return True
        if reason is not None:
            choice.finish_reason = reason
        return False

    def end(self, reason: str) -> None:
        """Ends every unfinished choice with `reason` (an abort), flushing its held-back text."""
        for choice, detokenizer in zip(self.choices, self.detokenizers):
            if choice.finish_reason is None:
                if detokenizer is not None:
                    detokenizer.update([], final=True)
                    choice.text = detokenizer.text
                choice.finish_reason = reason

    def snapshot(self) -> RequestOutput:
        """The cumulative output now (copies: later steps do not change it); stored as `output`."""
        choices = [Choice(c.index, list(c.token_ids), c.text, None if c.logprobs is None else list(c.logprobs),
                          None if c.top_logprobs is None else [dict(t) for t in c.top_logprobs], c.finish_reason)
                   for c in self.choices]
        prompt = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        tops = None if self.prompt_top_logprobs is None else [
            None if top is None else dict(top) for top in self.prompt_top_logprobs]
        self.output = RequestOutput(self.request.request_id, self.request.prompt_token_ids, choices, prompt,
                                    self.finished, tops)
        return self.output
