"""Drives an engine `Scheduler` with a fake model over a simulated paged KV cache, checking it each step.

The fake model: the next token of a sequence is (sum of its known tokens) % 97. The cache
is simulated slot by slot: feeding token p of a sequence writes, into slot
`(block_table[p // block_size], p % block_size)`, what a real model's keys and values
depend on (the adapter and the whole prefix up to p). A sampled row reads its context back
through its block table, so a wrong table, a prefix-cache hit on the wrong block, or a
block overwritten by another sequence shows up as a mismatch. Everything the checks compare
against is the driver's own bookkeeping (prompts, sampled tokens, what it saw fed), never
the scheduler's.
"""

from __future__ import annotations

import collections
import math

from axcore.engine.scheduler import Scheduler

VOCAB = 97


def reference(prompt, params, max_model_len: int, eos: tuple[int, ...] = ()) -> tuple[list[int], str]:
    """The tokens and finish reason of one choice decoded alone by the fake model (OpenAI's rules)."""
    tokens, out = list(prompt), []
    while True:
        token = sum(tokens) % VOCAB
        tokens.append(token)
        out.append(token)
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class Driver:
    """Steps `scheduler` and checks, after every step, the invariants its docstrings promise."""

    def __init__(self, scheduler: Scheduler, eos: tuple[int, ...] = ()):
        self.sched, self.eos = scheduler, eos
        self.size = scheduler.allocator.block_size
        self.cache: dict[tuple[int, int], tuple] = {}
        # seq id -> (request, choice index), for sequences not ended.
        self.live: dict[int, tuple] = {}
        # seq id -> known tokens (prompt + sampled), as the driver saw them.
        self.known: dict[int, list[int]] = {}
        # seq id -> next position it must feed; None when it (re)starts.
        self.next_pos: dict[int, int | None] = {}
        # (request id, choice) -> tokens sampled, and finish reason once ended.
        self.outputs: dict[tuple[str, int], list[int]] = {}
        self.reasons: dict[tuple[str, int], str] = {}
        # (request id, choice) -> (reference tokens, reference reason).
        self.expected: dict[tuple[str, int], tuple[list[int], str]] = {}
        self.plans = []
        self.restarts = collections.Counter()

    def add(self, request) -> list[int]:
        ids = self.sched.add(request)
        want = reference(request.prompt_token_ids, request.params, self.sched.max_model_len, self.eos)
        for choice, seq_id in enumerate(ids):
            self.live[seq_id] = (request, choice)
            self.known[seq_id] = list(request.prompt_token_ids)
            self.next_pos[seq_id] = None
            self.outputs[request.request_id, choice] = []
            self.expected[request.request_id, choice] = want
        return ids

    def end(self, target, reason: str) -> None:
        """Finish a sequence (int) or a request (str) from outside, as the engine would."""
        ended = [s for s, (req, _) in self.live.items() if s == target or req.request_id == target]
        assert self.sched.finish(target, reason) == bool(ended)
        for seq_id in ended:
            request, choice = self.live.pop(seq_id)
            self.reasons[request.request_id, choice] = reason

    def plan(self):
        """Schedule one step and check the plan against the driver's bookkeeping."""
        plan = self.sched.schedule()
        assert len(plan.rows) <= self.sched.max_seqs
        assert plan.num_tokens <= self.sched.max_tokens_per_step
        assert len({row.seq_id for row in plan.rows}) == len(plan.rows)
        assert not {row.seq_id for row in plan.rows} & set(plan.preempted)
        for seq_id in plan.preempted:
            self.next_pos[seq_id] = None
            self.restarts[seq_id] += 1
        for row in plan.rows:
            self._check_row(row)
        self.plans.append(plan)
        return plan

    def _check_row(self, row) -> None:
        known, end = self.known[row.seq_id], row.start + len(row.tokens)
        request, choice = self.live[row.seq_id]
        assert (row.request_id, row.choice_index) == (request.request_id, choice)
        assert row.tokens and row.tokens == known[row.start:end]
        assert row.sample == (end == len(known))
        if self.next_pos[row.seq_id] is None:
            # A (re)start may skip only whole cached blocks, and always feeds the last known token.
            assert row.start % self.size == 0 and row.start < len(known)
        else:
            assert row.start == self.next_pos[row.seq_id]
        self.next_pos[row.seq_id] = end
        assert len(row.block_table) == math.ceil(end / self.size)
        assert all(0 < block < self.sched.allocator.num_blocks for block in row.block_table)
        for p in range(row.start, end):
            # A block written in this step belongs to this sequence alone.
            assert self.sched.allocator.refcount(row.block_table[p // self.size]) == 1

    def run(self, plan):
        """The fake model on `plan` (writes every row, then reads the sampled rows' contexts); finish_step.

        A row whose sequence ended after planning still writes (junk, as a real batch would)
        into its blocks, now free; nothing may read those writes.
        """
        for row in plan.rows:
            live = self.live.get(row.seq_id)
            for i, p in enumerate(range(row.start, row.start + len(row.tokens))):
                slot = (row.block_table[p // self.size], p % self.size)
                prefix = tuple(self.known[row.seq_id][:row.start]) + tuple(row.tokens[:i + 1])
                self.cache[slot] = (live[0].adapter, prefix) if live else ("ended",)
        sampled = {}
        for row in plan.rows:
            if row.sample and row.seq_id in self.live:
                request, _ = self.live[row.seq_id]
                known = self.known[row.seq_id]
                for p in range(len(known)):
                    slot = (row.block_table[p // self.size], p % self.size)
                    assert self.cache.get(slot) == (request.adapter, tuple(known[:p + 1])), (row.seq_id, p)
                sampled[row.seq_id] = sum(known) % VOCAB
        updates = self.sched.finish_step(plan, sampled)
        self._apply(updates, sampled)
        self.check_state()
        return updates

    def step(self):
        """One planned, run and checked step; its updates."""
        return self.run(self.plan())

    def _apply(self, updates, sampled) -> None:
        assert sorted(u.seq_id for u in updates) == sorted(sampled)
        for update in updates:
            request, choice = self.live[update.seq_id]
            key = (request.request_id, choice)
            assert (update.request_id, update.choice_index, update.new_token) == (*key, sampled[update.seq_id])
            self.known[update.seq_id].append(update.new_token)
            out = self.outputs[key]
            out.append(update.new_token)
            want, reason = self.expected[key]
            assert out == want[:len(out)], key
            assert update.finish_reason == (reason if len(out) == len(want) else None), key
            if update.finish_reason is not None:
                self.reasons[key] = update.finish_reason
                del self.live[update.seq_id]

    def check_state(self) -> None:
        """Reference counts, sharing and the gauges against the live block tables."""
        alloc = self.sched.allocator
        tables = {seq_id: self.sched.sequence(seq_id).block_table for seq_id in self.live}
        holders = collections.defaultdict(list)
        for seq_id, table in tables.items():
            assert len(set(table)) == len(table)
            for index, block in enumerate(table):
                holders[block].append((seq_id, index))
        for block in range(1, alloc.num_blocks):
            assert alloc.refcount(block) == len(holders.get(block, [])), block
        for block, held in holders.items():
            if len(held) > 1:
                self._check_shared(block, held)
        assert alloc.num_used == len(holders) and alloc.num_free == alloc.num_blocks - 1 - len(holders)
        stats = self.sched.stats()
        assert stats.running + stats.waiting == len(self.live)
        assert stats.running <= self.sched.max_seqs
        assert stats.running == sum(1 for table in tables.values() if table)

    def _check_shared(self, block, held) -> None:
        """A block in several tables is one full, computed block of one prefix, at one index."""
        indices = {index for _, index in held}
        assert len(indices) == 1, (block, held)
        (index,) = indices
        prefixes = set()
        for seq_id, _ in held:
            fed = self.next_pos[seq_id]
            assert fed is not None and fed >= (index + 1) * self.size, (block, held)
            request, _ = self.live[seq_id]
            prefixes.add((request.adapter, tuple(self.known[seq_id][:(index + 1) * self.size])))
        assert len(prefixes) == 1, (block, held)

    def drain(self, limit: int = 2000) -> None:
        """Step until every sequence has ended; then no block is in use."""
        for _ in range(limit):
            if not self.live:
                break
            self.step()
        assert not self.live and not self.sched.has_unfinished()
        assert self.sched.allocator.num_used == 0
