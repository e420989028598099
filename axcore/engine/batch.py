"""One step's plan as arrays: the model call's inputs and the sampler's (host side, NumPy).

`split_calls` cuts a step's plan into the plans of its model calls. `pack_rows` lays a `StepPlan`'s rows out in the SHARED INTERFACE of `axcore.engine`
(`tokens`, `positions`, `num_new`, `block_tables`, unpadded: the `ModelRunner` pads to its
buckets); `pack_ragged` lays them out one token per row (a ragged step). `prompt_targets` says, for rows that compute a prompt whose log-probabilities
were asked, which token each position's logits predict. `sampling_rows` and `history`
give `axcore.engine.sampling` its per-row parameters and, when some row has a penalty,
each row's tokens so far.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence as Seq

import numpy as np

from axcore.engine.sampling import SamplingRow
from axcore.engine.sequence import Row, Sequence, StepPlan

# The cost model `split_calls` minimises, in padded positions (one position: one token through every
# layer's weights). A call also reads every weight once (CALL_COST_TOKENS), and the paged attention
# gathers each row's padded block table (BLOCK_COST_TOKENS per row and block; measured on the CPU for
# a 135M model: a decode row's 64 blocks cost about 6 positions).
CALL_COST_TOKENS = 64
BLOCK_COST_TOKENS = 0.1


def split_calls(plan: StepPlan, call_cost: Callable[[int, int, int], float]) -> list[StepPlan]:
    """`plan` as the plans of its model calls: decode rows (one token each) apart from prefill chunks, each
    kind cut into the groups of rows that cost least.

    Packed together, `[B, T, W]` pads every row to the longest chunk, the rows to a batch
    bucket and the block tables to the longest: 15 decodes beside one 256-token chunk would
    compute 16 x 256 positions, chunks of 9, 233 and 14 tokens 4 x 256, and 31 short decodes
    beside one long sequence would each gather its 64 blocks. `call_cost(rows, tokens, width)`
    estimates a call of that many rows, longest chunk and widest block table (the engine's:
    padded to the runner's buckets). The chunks, longest first, and the decode
    rows, widest table first, are each cut into consecutive groups minimising the summed cost
    (a dynamic programme over at most `max_seqs` rows). The decode calls come first; the first
    call carries the plan's preemptions.
    """
    single = sorted((row for row in plan.rows if len(row.tokens) == 1), key=lambda row: -len(row.block_table))
    chunks = sorted((row for row in plan.rows if len(row.tokens) > 1), key=lambda row: -len(row.tokens))
    parts = _cheapest_groups(single, call_cost) + _cheapest_groups(chunks, call_cost)
    if len(parts) == 1:
        return [plan]
    return [StepPlan(rows=rows, preempted=plan.preempted if i == 0 else []) for i, rows in enumerate(parts)]


def _cheapest_groups(rows: list[Row], call_cost: Callable[[int, int, int], float]) -> list[list[Row]]:
    """`rows` (in order) cut into consecutive groups of least summed `call_cost` (rows, longest chunk, widest
    table); none for no rows."""
    best, cut = [0.0] + [math.inf] * len(rows), [0] * (len(rows) + 1)
    for end in range(1, len(rows) + 1):
        tokens = width = 0
        for first in range(end - 1, -1, -1):  # Groups rows[first:end], widening to the left.
            tokens, width = max(tokens, len(rows[first].tokens)), max(width, len(rows[first].block_table))
            cost = best[first] + call_cost(end - first, tokens, width)
            if cost < best[end]:
                best[end], cut[end] = cost, first
    groups, end = [], len(rows)
    while end:
        groups.append(rows[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def pack_rows(rows: Seq[Row]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(tokens [b, t], positions [b, t], num_new [b], block_tables [b, w])` int32 of `rows`.

    t is the longest chunk, w the longest block table; chunks are left-aligned and padded
    with token 0 at position 0, tables padded with the null block 0.
    """
    b = len(rows)
    t = max(len(row.tokens) for row in rows)
    tokens, positions = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    num_new = np.zeros(b, np.int32)
    for i, row in enumerate(rows):
        count = len(row.tokens)
        tokens[i, :count] = row.tokens
        positions[i, :count] = np.arange(row.start, row.start + count)
        num_new[i] = count
    return tokens, positions, num_new, _block_tables(rows)


def _block_tables(rows: Seq[Row]) -> np.ndarray:
    """`[b, w]` int32: each row's block table, padded with the null block 0 to the longest (w)."""
    tables = np.zeros((len(rows), max(len(row.block_table) for row in rows)), np.int32)
    for i, row in enumerate(rows):
        tables[i, : len(row.block_table)] = row.block_table
    return tables


def pack_ragged(rows: Seq[Row]) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray,
                                          np.ndarray]:
    """`rows` one token per row: `((tokens [n, 1], positions [n, 1], num_new [n], block_tables [n, w]),
    logit_rows [b], owner [n])` int32, n the plan's tokens.

    Row i's chunk takes consecutive rows in order, each with row i's block table (w the
    longest); `logit_rows[i]` is the row of its last token (whose logits it samples from),
    `owner[r]` the plan row that token came from.
    """
    counts = np.array([len(row.tokens) for row in rows], np.int64)
    owner = np.repeat(np.arange(len(rows)), counts).astype(np.int32)
    tokens = np.concatenate([np.asarray(row.tokens, np.int32) for row in rows])[:, None]
    positions = np.concatenate([np.arange(row.start, row.start + len(row.tokens), dtype=np.int32)
                                for row in rows])[:, None]
    arrays = (tokens, positions, np.ones(len(owner), np.int32), _block_tables(rows)[owner])
    return arrays, (np.cumsum(counts) - 1).astype(np.int32), owner


def needs_prompt_logprobs(row: Row, seq: Sequence) -> bool:
    """Whether `row` computes prompt tokens whose log-probabilities its request asked for.

    Only a request's first choice computes them, the first time through its prompt (a
    recomputation after preemption computes the same numbers again, harmlessly).
    """
    return (seq.request.params.prompt_logprobs is not None and seq.choice_index == 0 and not seq.prompt_done
            and row.start < seq.num_prompt - 1)


def prompt_targets(rows: Seq[Row], seqs: Seq[Sequence], width: int) -> tuple[np.ndarray, list[list[int]]]:
    """The token each fed position's logits predict, for rows that need prompt log-probabilities.

    Returns `(targets [b, width] int32, positions)`: `positions[i]` lists the prompt
    positions p + 1 (p fed in row i at column p - start) whose log-probabilities row i
    gives; rows that need none have an empty list (and targets 0).
    """
    targets = np.zeros((len(rows), width), np.int32)
    wanted: list[list[int]] = []
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        wanted.append([])
        if not needs_prompt_logprobs(row, seq):
            continue
        for j in range(len(row.tokens)):
            nxt = row.start + j + 1
            if nxt < seq.num_prompt:
                targets[i, j] = seq.token_ids[nxt]
                wanted[-1].append(nxt)
    return targets, wanted


def sampling_rows(rows: Seq[Row], seqs: Seq[Sequence], indices: Seq[int]) -> list[SamplingRow | None]:
    """Per row, what the sampler needs (None: a row that samples nothing, a prompt chunk not at its end).

    `indices[i]` is row i's request's arrival rank in the engine.
    """
    return [SamplingRow(seq.request.params, index, seq.choice_index, seq.num_generated) if row.sample else None
            for row, seq, index in zip(rows, seqs, indices)]


def has_penalty(seqs: Seq[Sequence]) -> bool:
    """Whether some sequence's request sets a repetition, presence or frequency penalty."""
    return any(p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
               for p in (seq.request.params for seq in seqs))


def history(seqs: Seq[Sequence], size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(history [size, L], prompt_lens [size])`: each sequence's prompt and output ids, -1 padded.

    L is the longest sequence rounded up to a power of two (few compiled sampler shapes);
    rows past `len(seqs)` are empty.
    """
    longest = max(len(seq.token_ids) for seq in seqs)
    width = 1 << max(longest - 1, 0).bit_length()
    ids, lens = np.full((size, width), -1, np.int32), np.zeros(size, np.int32)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq.token_ids)] = seq.token_ids
        lens[i] = seq.num_prompt
    return ids, lens
