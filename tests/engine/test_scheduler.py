"""Scheduler, by hand: chunked prefill, joins mid-flight, preemption with recompute, siblings, stops, aborts.

Every case runs through `scheduler_driver.Driver`: a fake model (next token = sum of the
sequence's tokens % 97) over a simulated paged cache, checked each step against the
driver's own bookkeeping; the expected streams come from decoding each prompt alone.
"""

import pytest
from scheduler_driver import Driver, reference

from axcore import AxcoreError
from axcore.engine.blocks import BlockAllocator
from axcore.engine.requests import GenerationRequest, SamplingParams, SamplingParamsError
from axcore.engine.scheduler import Scheduler
from axcore.errors import ConfigError


def driver(num_blocks=17, block_size=4, max_seqs=2, budget=4, max_model_len=32, eos=()):
    alloc = BlockAllocator(num_blocks, block_size)
    sched = Scheduler(alloc, max_seqs=max_seqs, max_tokens_per_step=budget, max_model_len=max_model_len,
                      eos_token_ids=eos)
    return Driver(sched, eos)


def request(rid, prompt, adapter=None, **params):
    return GenerationRequest(rid, prompt, SamplingParams(**params), adapter=adapter)


def test_a_long_prompt_is_prefilled_in_three_chunks_then_decodes():
    d = driver(budget=4)
    prompt = list(range(1, 11))
    d.add(request("a", prompt, max_tokens=3))
    rows = []
    for _ in range(3):
        plan = d.plan()
        rows += plan.rows
        d.run(plan)
    assert [(r.tokens, r.start, r.sample) for r in rows] == [
        (prompt[0:4], 0, False), (prompt[4:8], 4, False), (prompt[8:10], 8, True)]
    assert [len(r.block_table) for r in rows] == [1, 2, 3]
    assert rows[2].block_table[:2] == rows[1].block_table and rows[1].block_table[:1] == rows[0].block_table
    d.drain()
    assert d.outputs["a", 0] == reference(prompt, SamplingParams(max_tokens=3), 32)[0]
    assert len(d.outputs["a", 0]) == 3 and d.reasons["a", 0] == "length"


def test_a_request_joins_while_another_decodes_and_shares_the_step():
    d = driver(budget=4)
    d.add(request("a", [3, 1, 4, 1, 5], max_tokens=6))
    d.step()
    d.step()
    assert d.outputs["a", 0] and d.sched.sequence(0).remaining == 1
    d.add(request("b", [9, 2, 6, 5, 3, 5], max_tokens=2))
    plans = [d.plan()]
    d.run(plans[0])
    plans.append(d.plan())
    d.run(plans[1])
    shapes = [[(r.request_id, r.start, len(r.tokens), r.sample) for r in p.rows] for p in plans]
    assert shapes == [[("a", 5, 1, True), ("b", 0, 3, False)], [("a", 6, 1, True), ("b", 3, 3, True)]]
    d.drain()
    assert d.outputs["a", 0] == reference([3, 1, 4, 1, 5], SamplingParams(max_tokens=6), 32)[0]
    assert d.outputs["b", 0] == reference([9, 2, 6, 5, 3, 5], SamplingParams(max_tokens=2), 32)[0]


def test_running_out_of_blocks_preempts_the_latest_arrival_which_recomputes_the_same_stream():
    d = driver(num_blocks=5, block_size=4, max_seqs=2, budget=8, max_model_len=16)
    a = d.add(request("a", [1, 2, 3, 4, 5, 6], max_tokens=10))[0]
    b = d.add(request("b", [7, 8, 9, 10, 11, 12], max_tokens=10))[0]
    preempted_with = None
    for _ in range(60):
        if not d.live:
            break
        plan = d.plan()
        if plan.preempted:
            assert plan.preempted == [b] and [r.seq_id for r in plan.rows] == [a]
            preempted_with = list(d.known[b])
        d.run(plan)
    assert preempted_with is not None and len(preempted_with) > 6
    assert d.sched.stats().preemptions == d.restarts[b] == 1
    # b restarted from scratch (its cached head was evicted by a), feeding its prompt and the tokens it had.
    restart = next(r for p in d.plans for r in p.rows if r.seq_id == b and r.start == 0 and r.sample)
    assert restart.tokens == preempted_with
    for rid, prompt in (("a", [1, 2, 3, 4, 5, 6]), ("b", [7, 8, 9, 10, 11, 12])):
        assert d.outputs[rid, 0] == reference(prompt, SamplingParams(max_tokens=10), 16)[0]
        assert len(d.outputs[rid, 0]) == 10 and d.reasons[rid, 0] == "length"
    assert d.sched.allocator.num_used == 0


def test_three_choices_share_the_prompt_blocks_and_feed_only_the_partial_block():
    d = driver(budget=6, max_seqs=4)
    prompt = [5, 3, 8, 1, 9, 9, 2, 7, 4, 6]
    first, *siblings = d.add(request("r", prompt, n=3, max_tokens=3))
    # The first choice prefills alone, in two chunks; its siblings wait for its prompt's blocks.
    for start, count in ((0, 6), (6, 4)):
        plan = d.plan()
        assert [(r.seq_id, r.start, len(r.tokens)) for r in plan.rows] == [(first, start, count)]
        assert d.sched.stats().waiting == 2
        d.run(plan)
    plan = d.plan()
    assert [(r.seq_id, r.start, r.tokens, r.sample) for r in plan.rows] == [
        (first, 10, d.outputs["r", 0], True), (siblings[0], 8, [4, 6], True), (siblings[1], 8, [4, 6], True)]
    head = plan.rows[0].block_table[:2]
    assert all(r.block_table[:2] == head for r in plan.rows)
    assert len({r.block_table[2] for r in plan.rows}) == 3
    assert [d.sched.allocator.refcount(block) for block in head] == [3, 3]
    d.run(plan)
    d.drain()
    want = reference(prompt, SamplingParams(max_tokens=3), 32)[0]
    assert [d.outputs["r", i] for i in range(3)] == [want] * 3
    stats = d.sched.stats()
    # (10 - 1) // 4 = 2 full blocks looked up per choice; the siblings find both.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (6, 4)
    assert (stats.prompt_tokens, stats.generation_tokens) == (10 + 2 + 2, 9)


def test_a_prefill_that_preempts_a_decode_already_in_the_step_takes_its_row_out():
    """A sibling released after its first choice ended, its prompt blocks evicted meanwhile, prefills
    in chunks while a later request decodes; when its chunk needs a block and none is free, the
    later request (planned first, as a decode) is preempted and its row leaves the step."""
    d = driver(num_blocks=8, block_size=2, max_seqs=3, budget=4, max_model_len=12)
    script = [([2, 3, 2], 1, 4, 1), ([3, 3, 1, 1, 3], 3, 1, 1), ([1, 1, 3, 3, 2, 1, 3, 3], 2, 4, 2),
              ([2, 1, 2, 3, 2, 3, 2, 3, 2, 3], 1, 2, 2)]
    for i, (prompt, n, max_tokens, steps) in enumerate(script):
        d.add(request(f"r{i}", prompt, n=n, max_tokens=max_tokens))
        for _ in range(steps):
            d.step()
    while d.live:
        pending = {s: len(d.known[s]) - (d.next_pos[s] or 0) for s in d.live}
        plan = d.plan()
        d.run(plan)
        victims = [s for s in plan.preempted if pending[s] == 1]
        if any(pending[r.seq_id] > 1 and r.seq_id < min(victims) for r in plan.rows if victims):
            break
    else:
        raise AssertionError("no prefill preempted a decode planned in the same step")
    d.drain()
    for i, (prompt, n, max_tokens, _) in enumerate(script):
        want = reference(prompt, SamplingParams(max_tokens=max_tokens), 12)[0]
        assert [d.outputs[f"r{i}", c] for c in range(n)] == [want] * n


def test_a_later_request_with_the_same_prefix_reuses_freed_blocks_but_not_another_adapters():
    d = driver(budget=16, max_seqs=4)
    prompt = list(range(20, 29))
    d.add(request("a", prompt, max_tokens=1))
    d.drain()
    d.add(request("b", prompt + [1, 2], max_tokens=1))
    d.add(request("c", prompt, max_tokens=1, adapter="lora"))
    d.add(request("d", prompt, max_tokens=1, prompt_logprobs=0))
    starts = {r.request_id: r.start for r in d.plan().rows}
    # b: 2 full blocks of the base; c: its adapter computed nothing yet; d wants every prompt token's logits.
    assert starts == {"b": 8, "c": 0, "d": 0}
    d.run(d.plans[-1])
    d.drain()
    for rid, tokens in (("b", prompt + [1, 2]), ("c", prompt), ("d", prompt)):
        assert d.outputs[rid, 0] == reference(tokens, SamplingParams(max_tokens=1), 32)[0]


def test_stop_tokens_eos_and_ignore_eos():
    d = driver(budget=8, max_seqs=3, eos=(10,))
    # From the prompt [5] the fake model says 5, 10, 20, 40, ...
    d.add(request("eos", [5], max_tokens=8))
    d.add(request("ignore", [5], max_tokens=4, ignore_eos=True))
    d.add(request("stop", [5], max_tokens=8, ignore_eos=True, stop_token_ids=[20]))
    d.drain()
    assert d.outputs == {("eos", 0): [5, 10], ("ignore", 0): [5, 10, 20, 40], ("stop", 0): [5, 10, 20]}
    assert d.reasons == {("eos", 0): "stop", ("ignore", 0): "length", ("stop", 0): "stop"}


def test_a_full_context_ends_with_length():
    d = driver(budget=8, max_model_len=8)
    d.add(request("a", [1, 2, 3], max_tokens=5))
    d.drain()
    assert len(d.outputs["a", 0]) == 5 and d.reasons["a", 0] == "length"


def test_an_abort_while_a_step_is_in_flight_frees_its_blocks_and_drops_its_token():
    d = driver(budget=8, max_seqs=2)
    d.add(request("a", [1, 2, 3, 4, 5], max_tokens=8))
    d.add(request("b", [6, 7, 8], max_tokens=4))
    d.step()
    plan = d.plan()
    assert {r.request_id for r in plan.rows} == {"a", "b"}
    d.end("a", "abort")
    updates = d.run(plan)
    assert [u.request_id for u in updates] == ["b"]
    assert not d.sched.abort("a")
    d.drain()
    assert d.reasons["a", 0] == "abort" and d.outputs["b", 0] == reference([6, 7, 8], SamplingParams(max_tokens=4), 32)[0]


def test_finishing_one_choice_leaves_its_siblings_running():
    d = driver(budget=8, max_seqs=4)
    ids = d.add(request("r", [1, 2, 3], n=3, max_tokens=6))
    d.step()
    d.step()
    d.end(ids[1], "stop")
    assert d.sched.stats().running == 2
    d.drain()
    assert d.reasons == {("r", 0): "length", ("r", 1): "stop", ("r", 2): "length"}


def test_refusals_name_the_field():
    sched = driver(max_model_len=10).sched
    with pytest.raises(SamplingParamsError, match="'prompt'"):
        sched.add(request("a", list(range(10))))
    with pytest.raises(SamplingParamsError, match="'max_tokens'.*at most 3"):
        sched.add(request("a", list(range(7)), max_tokens=4))
    sched.add(request("a", list(range(7)), max_tokens=3))
    with pytest.raises(SamplingParamsError, match="'request_id'"):
        sched.add(request("a", [1]))
    assert sched.stats().waiting == 1


@pytest.mark.parametrize("limits, field", [
    (dict(max_seqs=0, max_tokens_per_step=8, max_model_len=8), "max_seqs"),
    (dict(max_seqs=4, max_tokens_per_step=3, max_model_len=8), "max_tokens_per_step"),
    (dict(max_seqs=1, max_tokens_per_step=8, max_model_len=17), "max_model_len"),
])
def test_limits_no_sequence_could_live_with_are_refused(limits, field):
    with pytest.raises(ConfigError, match=f"'{field}'") as caught:
        Scheduler(BlockAllocator(5, 4), **limits)
    assert isinstance(caught.value, AxcoreError)


def test_reset_cache_recomputes_every_running_sequence_and_forgets_the_prefix_cache():
    """New weights: running sequences lose their blocks (kept tokens, fed again from position 0) and no block
    registered before is found again; the streams still equal each prompt decoded alone."""
    d = driver(budget=16, max_seqs=2)
    prompts = {"a": list(range(1, 10)), "b": list(range(20, 26))}
    for rid, prompt in prompts.items():
        d.add(request(rid, prompt, max_tokens=4))
    d.step()
    d.step()
    known = {seq: list(tokens) for seq, tokens in d.known.items() if seq in d.live}
    assert d.sched.allocator.num_cached > 0
    d.sched.reset_cache()
    d.next_pos.update(dict.fromkeys(known))  # The driver's bookkeeping: they restart.
    stats = d.sched.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used, stats.preemptions) == (0, 2, 0, 2)
    assert d.sched.allocator.num_cached == 0
    plan = d.plan()
    assert {r.seq_id for r in plan.rows} == set(known)  # Both fed again from position 0 (the budget chunks b).
    assert all(r.start == 0 and r.tokens == known[r.seq_id][: len(r.tokens)] for r in plan.rows)
    d.run(plan)
    d.drain()
    for rid, prompt in prompts.items():
        assert d.outputs[rid, 0] == reference(prompt, SamplingParams(max_tokens=4), 32)[0]
