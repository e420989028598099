"""What the scheduler tracks per choice (`Sequence`) and what one step plans and returns (plain data).

A request of `n` choices becomes `n` sequences. A sequence's known tokens are its prompt
and every token sampled so far; `num_computed` of them have their keys and values in the
KV cache (fed in an earlier step or found in the prefix cache), always a prefix. Token at
absolute position `p` lives in block `block_table[p // block_size]`, offset
`p % block_size`.
"""

from __future__ import annotations

import dataclasses
import enum

from axcore.engine.blocks import prefix_hash
from axcore.engine.requests import GenerationRequest


class SeqStatus(enum.Enum):
    """Where a sequence is."""

    # A sibling choice waiting for the first choice's prompt to be computed (then it hits the cache).
    HELD = "held"
    # In the waiting queue (new, released sibling, or preempted): holds no block.
    WAITING = "waiting"
    # Admitted: holds blocks, gets a row in a step while the token budget lasts.
    RUNNING = "running"
    # Done: its blocks are freed.
    FINISHED = "finished"


class Sequence:
    """One choice of a request: its tokens, how many are cached, its block table.

    The engine reads it (`Scheduler.sequence(seq_id)`) for sampling state (the request's
    params, `token_ids`, `num_prompt`); only the scheduler changes it.
    """

    def __init__(self, seq_id: int, request: GenerationRequest, choice_index: int, order: int):
        # Unique id among the scheduler's sequences, ever.
        self.seq_id = seq_id
        # The request this choice belongs to.
        self.request = request
        # Its index among the request's choices.
        self.choice_index = choice_index
        # Rank of the request's arrival (FIFO: lower runs first).
        self.order = order
        # Prompt then sampled tokens, in order.
        self.token_ids: list[int] = list(request.prompt_token_ids)
        # Length of the prompt.
        self.num_prompt = len(request.prompt_token_ids)
        # Known tokens whose keys/values are in the cache (a prefix of token_ids).
        self.num_computed = 0
        # Block ids of its tokens, block i holding positions [i * block_size, (i + 1) * block_size).
        self.block_table: list[int] = []
        # Leading blocks of block_table already registered in (or taken from) the prefix cache.
        self.num_registered = 0
        # Whether its whole prompt has been computed once (prompt log-probabilities are then known).
        self.prompt_done = False
        # Where it is, and why it ended (None while not finished).
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self._keys: list[int] = []

    @property
    def sort_key(self) -> tuple[int, int]:
        """FIFO rank: the request's arrival, then the choice index."""
        return self.order, self.choice_index

    @property
    def remaining(self) -> int:
        """Known tokens not yet in the cache (1 for a sequence decoding)."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far."""
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        """The sampled tokens."""
        return self.token_ids[self.num_prompt:]

    def block_keys(self, count: int, block_size: int) -> list[int]:
        """Prefix-cache keys of its first `count` full blocks (each chains the one before it)."""
        if count * block_size > len(self.token_ids):
            raise RuntimeError(f"sequence {self.seq_id} has fewer than {count} full blocks")
        while len(self._keys) < count:
            i = len(self._keys)
            parent = self._keys[-1] if self._keys else None
            tokens = self.token_ids[i * block_size:(i + 1) * block_size]
            self._keys.append(prefix_hash(parent, tokens, self.request.adapter))
        return self._keys[:count]


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a step's batch: a chunk of one sequence's known tokens."""

    # The sequence, its request and its choice index.
    seq_id: int
    request_id: str
    choice_index: int
    # The tokens fed (a prompt chunk, a recomputed chunk, or the one last sampled token).
    tokens: list[int]
    # Absolute position of tokens[0]; tokens sit at consecutive positions.
    start: int
    # The sequence's block table for this step: exactly the blocks of positions < start + len(tokens).
    block_table: list[int]
    # True when tokens[-1] is the sequence's last known token: its logits give the next token.
    sample: bool


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one engine step runs: at most `max_seqs` rows, at most `max_tokens_per_step` tokens."""

    # Decodes first (arrival order), then prefill chunks.
    rows: list[Row]
    # Sequences preempted while planning this step (blocks freed; they recompute later).
    preempted: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens fed in this step, all rows together."""
        return sum(len(row.tokens) for row in self.rows)


@dataclasses.dataclass(frozen=True)
class SeqUpdate:
    """A token a step added to a sequence, and whether that ended it."""

    # The sequence, its request and its choice index.
    seq_id: int
    request_id: str
    choice_index: int
    # The token sampled for it.
    new_token: int
    # "stop" (a stop or end-of-sequence token) or "length" (max_tokens, max_model_len); None if it goes on.
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's part of `EngineStats` (same field names and meanings)."""

    # Sequences waiting to run (new, preempted, or siblings waiting for their prompt).
    waiting: int
    # Sequences admitted (holding blocks).
    running: int
    # Blocks held by a live sequence; blocks free (cached-but-unused ones included).
    kv_blocks_used: int
    kv_blocks_free: int
    # Full blocks looked up in the prefix cache when a sequence (re)starts, and found.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Prompt tokens fed to the model (cache hits excluded, recomputation included), tokens sampled.
    prompt_tokens: int
    generation_tokens: int
    # Sequences preempted since start.
    preemptions: int
