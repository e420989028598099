"""`split_calls`: a step's rows cut into model calls, checked against a brute force over every partition."""

import bisect
import itertools

import numpy as np
import pytest

from axcore.engine.batch import split_calls
from axcore.engine.sequence import Row, StepPlan

BATCH, TOKENS = (1, 2, 4, 8, 32), (1, 16, 32, 64, 128, 256)


def padded(rows: int, tokens: int) -> int:
    return BATCH[bisect.bisect_left(BATCH, rows)] * TOKENS[bisect.bisect_left(TOKENS, tokens)]


def cost_of(call_cost: int, block_cost: float = 0.0):
    """A `call_cost(rows, tokens, width)`: padded positions, `block_cost` per padded row and table block (widths
    padded to powers of two), `call_cost` per call."""
    def cost(rows: int, tokens: int, width: int) -> float:
        batch = BATCH[bisect.bisect_left(BATCH, rows)]
        return padded(rows, tokens) + batch * (1 << (width - 1).bit_length()) * block_cost + call_cost
    return cost


def _row(seq_id: int, length: int, blocks: int = 1) -> Row:
    return Row(seq_id, f"r{seq_id}", 0, list(range(length)), 0, [1] * blocks, True)


def _partitions(items: list):
    """Every set partition of `items` (as lists of lists)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1:]]


def _cost(groups: list[list[Row]], cost) -> float:
    return sum(cost(len(g), max(len(r.tokens) for r in g), max(len(r.block_table) for r in g)) for g in groups)


@pytest.mark.parametrize("seed", range(12))
def test_prefill_chunks_go_to_the_cheapest_calls_after_the_decodes(seed):
    """Random steps of up to 6 chunks and 3 decodes: the decodes' calls come first, the first call carries the
    preemptions; the chunks' calls cost (padded positions + call_cost each) the minimum over every partition of the chunks."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([2, 9, 14, 16, 30, 70, 120, 233, 256], size=rng.integers(1, 7)).tolist()
    decodes = [_row(100 + i, 1) for i in range(int(rng.integers(0, 4)))]
    chunks = [_row(i, n) for i, n in enumerate(lengths)]
    rows = list(rng.permutation(np.array(decodes + chunks, dtype=object)))
    cost = cost_of(int(rng.choice([0, 16, 64, 500])))
    parts = split_calls(StepPlan(rows=rows, preempted=[7]), cost)
    assert sorted(r.seq_id for p in parts for r in p.rows) == sorted(r.seq_id for r in rows)
    assert [p.preempted for p in parts] == [[7]] + [[]] * (len(parts) - 1)
    kinds = [{len(r.tokens) == 1 for r in p.rows} for p in parts]
    first_chunk = kinds.index({False}) if {False} in kinds else len(parts)
    assert kinds == [{True}] * first_chunk + [{False}] * (len(parts) - first_chunk)  # Decode calls first.
    groups = [p.rows for p in parts[first_chunk:]]
    assert _cost(groups, cost) == min(_cost(partition, cost) for partition in _partitions(chunks))
    if not decodes and len(chunks) == 1:
        assert groups == [rows]


@pytest.mark.parametrize("seed", range(12))
def test_decode_rows_go_to_the_cheapest_calls_by_block_table_width(seed):
    """Up to 7 decode rows with tables of 1-64 blocks: their calls cost the minimum over every partition (each
    padded block of each padded row costing 0.1-2 positions, a call 0-64), and every row runs once."""
    rng = np.random.default_rng(100 + seed)
    decodes = [_row(i, 1, int(rng.integers(1, 65))) for i in range(int(rng.integers(1, 8)))]
    cost = cost_of(int(rng.choice([0, 16, 64])), float(rng.choice([0.1, 0.5, 2.0])))
    parts = split_calls(StepPlan(rows=decodes, preempted=[]), cost)
    assert sorted(r.seq_id for p in parts for r in p.rows) == list(range(len(decodes)))
    assert _cost([p.rows for p in parts], cost) == min(_cost(p, cost) for p in _partitions(decodes))


def test_one_long_sequence_does_not_widen_every_decode_row():
    """31 decode rows of 4 blocks beside one of 60: apart, the 31 gather 4 blocks each, not 64."""
    rows = [_row(i, 1, 4) for i in range(31)] + [_row(31, 1, 60)]
    parts = split_calls(StepPlan(rows=rows, preempted=[]), cost_of(64, 0.1))
    assert [[len(r.block_table) for r in p.rows] for p in parts] == [[60], [4] * 31]


def test_chunks_of_9_233_and_14_tokens_beside_decodes_run_apart():
    """The case that made a prefill call pad 256 valid tokens to 4 x 256: apart they pad to 16 + 256 + 16."""
    rows = [_row(0, 1), _row(1, 9), _row(2, 233), _row(3, 14)]
    parts = split_calls(StepPlan(rows=rows, preempted=[]), cost_of(64))
    assert [[len(r.tokens) for r in p.rows] for p in parts] == [[1], [233], [14, 9]]
    assert sum(padded(len(p.rows), max(len(r.tokens) for r in p.rows)) for p in parts) == 1 + 256 + 2 * 16


def test_a_plan_of_decodes_only_or_one_chunk_only_is_one_call():
    for rows in ([_row(0, 1), _row(1, 1)], [_row(0, 40)]):
        plan = StepPlan(rows=rows, preempted=[3])
        assert split_calls(plan, cost_of(64, 0.1)) == [plan]


def test_every_partition_is_enumerated():
    """The brute force's own check: a set of n items has Bell(n) partitions."""
    assert [sum(1 for _ in _partitions(list(range(n)))) for n in range(1, 7)] == [1, 2, 5, 15, 52, 203]
    assert all(sorted(itertools.chain(*p)) == list(range(4)) for p in _partitions(list(range(4))))
