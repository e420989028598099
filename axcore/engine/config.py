"""The engine's settings (`EngineConfig`) and what they resolve to for one model (`resolve`).

Sizing the KV cache: `num_blocks` blocks of `block_size` tokens per attention layer, or
(`num_blocks=None`) as many blocks as `kv_cache_bytes` holds over all layers. Buckets:
a step's rows are padded to the smallest batch bucket holding them and its longest chunk
to the smallest token bucket, so the compiled programs are at most
`len(batch_buckets) * len(token_buckets) * (table widths) * 2`, plus with ragged steps
`len(ragged_buckets) * (table widths)` (the runner counts them and
refuses one past `max_programs`). Table widths are powers of two blocks, then the longest
table; for ragged steps whose attention reads blocks in place, 64 blocks, then 8x wider
each time (`ModelRunner.widen_ragged_tables`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from axcore.errors import AxcoreError, ConfigError


class EngineError(AxcoreError):
    """An engine call cannot be honoured (e.g. `update_weights` with another parameter tree); says what to do."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its cache, batches its steps and bounds its compilation."""

    # Tokens per KV block (the prefix cache shares whole blocks).
    block_size: int = 16
    # KV blocks in the cache, the null block 0 included; None = as many as `kv_cache_bytes` holds.
    num_blocks: int | None = None
    # Bytes of KV cache over all attention layers, used when `num_blocks` is None.
    kv_cache_bytes: int = 1 << 30
    # Sequences running at once (rows of a step), at most.
    max_seqs: int = 16
    # Tokens fed per step, all rows together (decodes plus prefill chunks).
    max_tokens_per_step: int = 256
    # Known tokens per sequence (prompt plus generated); None = the model's position limit, else the whole cache.
    max_model_len: int | None = None
    # Row counts a step is padded to; None = powers of four up to max_seqs (and max_seqs).
    batch_buckets: tuple[int, ...] | None = None
    # Tokens per row a step is padded to; None = 1 (decode-only steps), then powers of two from 16 up to
    # max_tokens_per_step or max_model_len, whichever is smaller (and it).
    token_buckets: tuple[int, ...] | None = None
    # Tokens (rows) a ragged step is padded to; None = powers of two up to max_tokens_per_step (and it).
    ragged_buckets: tuple[int, ...] | None = None
    # Most compiled model programs; a step needing one more fails, naming this field.
    max_programs: int = 256
    # Seeds the draws of requests that set no seed (with their arrival rank).
    seed: int = 0
    # Run a step's decode rows as one model call and its prefill chunks as the calls that pad least (no
    # decode row padded to a long chunk; `batch.split_calls`); False: one call, whose programs' float32
    # rounding matches a full forward's more closely.
    split_mixed_steps: bool = True
    # One call per step with one token per row (a chunk's tokens on consecutive rows of its sequence; only
    # the rows that sample compute logits): no row padded to the longest chunk, the weights read once a
    # step. None = when the decode steps' paged_attention kernel reads blocks in place (its
    # `reads_blocks_in_place`: the rows' tables then cost nothing). Steps asking prompt log-probabilities
    # run unragged.
    ragged_steps: bool | None = None
    # Op name -> kernel the engine's programs try first (`axcore.kernels.preferred_kernels`; a layer's own
    # `kernels` choice still wins), e.g. {"paged_attention": "xla"}; None = the usual selection.
    kernels: dict[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Resolved:
    """`EngineConfig`'s None fields filled in for one model."""

    # KV blocks, the null block included.
    num_blocks: int
    # Known tokens per sequence at most.
    max_model_len: int
    # Batch and token buckets, ascending.
    batch_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    # Rows of a ragged step (one token each), ascending.
    ragged_buckets: tuple[int, ...]


def _powers_up_to(limit: int, start: int = 1, factor: int = 4) -> tuple[int, ...]:
    """`start`, factor * start, factor**2 * start, ... below `limit`, then `limit`.

    >>> _powers_up_to(16), _powers_up_to(256, 16), _powers_up_to(100, 16), _powers_up_to(256, 16, 2)
    ((1, 4, 16), (16, 64, 256), (16, 64, 100), (16, 32, 64, 128, 256))
    """
    sizes, size = {limit}, start
    while size < limit:
        sizes.add(size)
        size *= factor
    return tuple(sorted(sizes))


def block_bytes(model: Any, block_size: int) -> int:
    """Bytes one KV block takes over all of `model`'s attention layers (from the cache's abstract shapes)."""
    two = jax.eval_shape(lambda: model.init_paged_cache(2, block_size))
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(two)) // 2


def resolve(model: Any, config: EngineConfig) -> Resolved:
    """The settings in effect for `model`; ConfigError naming the field of a setting that cannot work."""
    for field in ("block_size", "max_seqs", "max_tokens_per_step", "max_programs"):
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"engine '{field}': must be a positive integer, got {value!r}")
    num_blocks = config.num_blocks
    if num_blocks is None:
        num_blocks = config.kv_cache_bytes // block_bytes(model, config.block_size)
        if num_blocks < 2:
            raise ConfigError(f"engine 'kv_cache_bytes': {config.kv_cache_bytes} bytes hold {num_blocks} KV blocks "
                              f"of {config.block_size} tokens; give at least two blocks' worth")
    limit = model.max_cache_len()
    cache_len = (num_blocks - 1) * config.block_size
    max_model_len = config.max_model_len or (cache_len if limit is None else min(limit, cache_len))
    if limit is not None and max_model_len > limit:
        raise ConfigError(f"engine 'max_model_len': {max_model_len} exceeds the model's {limit} positions; "
                          f"lower it to at most {limit}")
    batch = tuple(config.batch_buckets or _powers_up_to(config.max_seqs))
    # A chunk is never longer than max_model_len: no default bucket pads past it (nor past learned positions).
    longest_chunk = min(config.max_tokens_per_step, max_model_len)
    # Powers of two, not four: a prefill chunk padded to the next bucket wastes at most half its call.
    tokens = tuple(config.token_buckets or sorted({1, *_powers_up_to(longest_chunk, 16, factor=2)}))
    if max(batch) < config.max_seqs:
        raise ConfigError(f"engine 'batch_buckets': the largest, {max(batch)}, is below max_seqs "
                          f"{config.max_seqs}; add a bucket of {config.max_seqs}")
    if max(tokens) < min(config.max_tokens_per_step, max_model_len):
        raise ConfigError(f"engine 'token_buckets': the largest, {max(tokens)}, is below max_tokens_per_step "
                          f"{config.max_tokens_per_step} (a prefill chunk can be that long); add that bucket")
    # A ragged step feeds every token of the step on its own row; decodes are never more than max_seqs.
    most_rows = max(config.max_tokens_per_step, config.max_seqs)
    ragged = tuple(config.ragged_buckets or _powers_up_to(most_rows, 1, factor=2))
    if max(ragged) < most_rows:
        raise ConfigError(f"engine 'ragged_buckets': the largest, {max(ragged)}, is below the {most_rows} tokens "
                          f"a ragged step can feed (max_tokens_per_step, max_seqs); add that bucket")
    return Resolved(num_blocks, max_model_len, tuple(sorted(batch)), tuple(sorted(tokens)), tuple(sorted(ragged)))
