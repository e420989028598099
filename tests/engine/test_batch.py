"""`split_calls`: a step's rows cut into model calls, checked against a brute force over every partition."""

import bisect
import itertools

import numpy as np
import pytest

from axcore.engine.batch import split_calls
from axcore.engine.sequence import Row, StepPlan

BATCH, TOKENS = (1, 2, 4, 8), (1, 16, 32, 64, 128, 256)


def padded(rows: int, tokens: int) -> int:
    return BATCH[bisect.bisect_left(BATCH, rows)] * TOKENS[bisect.bisect_left(TOKENS, tokens)]


def _row(seq_id: int, length: int) -> Row:
    return Row(seq_id, f"r{seq_id}", 0, list(range(length)), 0, [1], True)


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


def _cost(groups: list[list[Row]], call_cost: int) -> int:
    return sum(padded(len(g), max(len(r.tokens) for r in g)) + call_cost for g in groups)


@pytest.mark.parametrize("seed", range(12))
def test_prefill_chunks_go_to_the_cheapest_calls_and_decodes_to_one(seed):
    """Random steps of up to 6 chunks and 3 decodes: the decodes are one call, first, with the preemptions; the
    chunks' calls cost (padded positions + call_cost each) the minimum over every partition of the chunks."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([2, 9, 14, 16, 30, 70, 120, 233, 256], size=rng.integers(1, 7)).tolist()
    decodes = [_row(100 + i, 1) for i in range(int(rng.integers(0, 4)))]
    chunks = [_row(i, n) for i, n in enumerate(lengths)]
    rows = list(rng.permutation(np.array(decodes + chunks, dtype=object)))
    call_cost = int(rng.choice([0, 16, 64, 500]))
    parts = split_calls(StepPlan(rows=rows, preempted=[7]), padded, call_cost)
    assert sorted(r.seq_id for p in parts for r in p.rows) == sorted(r.seq_id for r in rows)
    assert [p.preempted for p in parts] == [[7]] + [[]] * (len(parts) - 1)
    if decodes:
        assert sorted(r.seq_id for r in parts[0].rows) == [r.seq_id for r in decodes]
    groups = [p.rows for p in parts[1 if decodes else 0:]]
    assert all(len(r.tokens) > 1 for g in groups for r in g)
    best = min(_cost(partition, call_cost) for partition in _partitions(chunks))
    if decodes or len(chunks) > 1:
        assert _cost(groups, call_cost) == best
    else:
        assert groups == [rows]


def test_chunks_of_9_233_and_14_tokens_beside_decodes_run_apart():
    """The case that made a prefill call pad 256 valid tokens to 4 x 256: apart they pad to 16 + 256 + 16."""
    rows = [_row(0, 1), _row(1, 9), _row(2, 233), _row(3, 14)]
    parts = split_calls(StepPlan(rows=rows, preempted=[]), padded, 64)
    assert [[len(r.tokens) for r in p.rows] for p in parts] == [[1], [233], [14, 9]]
    assert sum(padded(len(p.rows), max(len(r.tokens) for r in p.rows)) for p in parts) == 1 + 256 + 2 * 16


def test_a_plan_of_decodes_only_or_one_chunk_only_is_one_call():
    for rows in ([_row(0, 1), _row(1, 1)], [_row(0, 40)]):
        plan = StepPlan(rows=rows, preempted=[3])
        assert split_calls(plan, padded) == [plan]


def test_every_partition_is_enumerated():
    """The brute force's own check: a set of n items has Bell(n) partitions."""
    assert [sum(1 for _ in _partitions(list(range(n)))) for n in range(1, 7)] == [1, 2, 5, 15, 52, 203]
    assert all(sorted(itertools.chain(*p)) == list(range(4)) for p in _partitions(list(range(4))))
