"""A fixed list of prompts run to the end on an engine (offline generation).

`axcore generate`, the trainer's end-of-run sample and lm-eval's `generate_until` all
decode this way: `offline_config` sizes an `EngineConfig` for the prompts at hand (a
cache that holds every running sequence whole, so nothing is preempted, and no more
rows than prompts), and `run_requests` adds the requests and steps the engine in the
caller's thread (so under the caller's op environment: its mesh and sharding rules)
until every one has finished.

    engine = Engine(model, params, tokenizer, config=offline_config(model, [len(p) for p in prompts], 64))
    outputs = run_requests(engine, [GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=64, temperature=0))
                                    for i, p in enumerate(prompts)])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from axcore.engine.config import EngineConfig, block_bytes
from axcore.engine.requests import GenerationRequest, RequestOutput

# Rows of an offline engine's steps at most (more prompts wait for a free row).
MAX_SEQS = 32
# The cache an offline engine allocates at most, in bytes over all layers (else the engine preempts).
MAX_CACHE_BYTES = 1 << 30


def offline_config(model: Any, prompt_lengths: Sequence[int], max_new_tokens: int, *, seed: int = 0,
                   max_seqs: int = MAX_SEQS, block_size: int = 16, max_cache_bytes: int = MAX_CACHE_BYTES
                   ) -> EngineConfig:
    """An `EngineConfig` for prompts of `prompt_lengths` tokens, each continued by up to `max_new_tokens`.

    Rows: `min(len(prompt_lengths), max_seqs)`. Blocks: the null block plus those of the
    longest sequences that can run at once (prompt plus new tokens each), so no sequence
    is preempted; when that exceeds `max_cache_bytes`, that budget instead. `seed` seeds
    the draws of requests that set none (with their arrival rank).
    """
    if not prompt_lengths:
        raise ValueError("offline_config needs at least one prompt length.")
    rows = max(1, min(len(prompt_lengths), max_seqs))
    blocks = sorted((-(-(int(n) + max_new_tokens) // block_size) for n in prompt_lengths), reverse=True)
    num_blocks = 1 + sum(blocks[:rows])
    if num_blocks * block_bytes(model, block_size) > max_cache_bytes:
        return EngineConfig(block_size=block_size, kv_cache_bytes=max_cache_bytes, max_seqs=rows, seed=seed)
    return EngineConfig(block_size=block_size, num_blocks=num_blocks, max_seqs=rows, seed=seed)


def run_requests(engine: Any, requests: Sequence[GenerationRequest],
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
    """Runs `requests` on `engine` (an `axcore.engine.Engine`) to the end; their final outputs, in order.

    The steps run in this thread. `progress(finished, total)` is called after every step
    that finished a request. A request the engine refuses (`SamplingParamsError`, naming
    the field) or a failed step leaves none of `requests` running: the others are aborted
    and the error is raised.
    """
    finals: dict[str, RequestOutput] = {}

    def sink(output: RequestOutput | BaseException) -> None:
        if isinstance(output, RequestOutput) and output.finished:
            finals[output.request_id] = output

    added: list[str] = []
    try:
        for request in requests:
            engine.add_request(request, sink)
            added.append(request.request_id)
        while len(finals) < len(requests):
            before = len(finals)
            engine.step()
            if progress is not None and len(finals) > before:
                progress(len(finals), len(requests))
    except BaseException:
        for rid in added:  # All or none: nothing of this call keeps running in the engine.
            engine.abort(rid)
        raise
    return [finals[request.request_id] for request in requests]


__all__ = ["MAX_CACHE_BYTES", "MAX_SEQS", "offline_config", "run_requests"]
