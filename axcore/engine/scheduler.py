"""Continuous batching: which sequences run each step, which chunk each feeds, and their blocks.

The scheduler owns admission, the token budget, preemption and the block allocator; the
engine owns the model call and sampling. One step is `plan = schedule()`, the model call(s)
on `plan.rows`, then `finish_step(plan, sampled)` (once, or once per part of a plan the engine
split by row width); one plan is in flight at a time.

Policy (FIFO by arrival, the order of `add` calls; a request's choices rank in index order):

1. Running sequences that decode (one known token not yet cached) get one token each.
2. Running sequences still prefilling (or recomputing) get a chunk each, as long as the
   step's token budget lasts (chunked prefill, mixed with the decodes of the same step).
3. Waiting sequences are admitted in order while fewer than `max_seqs` run, budget is left
   and their first chunk's blocks are free; the first that does not fit stops admission
   (no overtaking). A sequence (re)starting takes the full blocks of its known tokens that
   the prefix cache holds and does not feed them again, but always feeds its last known
   token, so that the step yields the logits of the next one. A request asking for prompt
   log-probabilities skips the cache until its prompt has been computed once.

When a running sequence needs a block and none is free, the most recently arrived running
sequence is preempted: its blocks are freed (tail first, so the cached head of a prompt
survives eviction longest) and it returns to the waiting queue in its arrival place,
keeping the tokens it generated, which it recomputes when readmitted. No sequence is
admitted in a step that preempted one.

Siblings (`n` > 1) share the prompt: the first choice runs alone until its prompt is
computed and its full blocks registered; then the others join and find those blocks in
the cache, feeding only the tokens after the last full block.
"""

from __future__ import annotations

import bisect
import math

from axcore.engine.blocks import BlockAllocator
from axcore.engine.requests import GenerationRequest, SamplingParamsError
from axcore.engine.sequence import Row, SchedulerStats, SeqStatus, Sequence, SeqUpdate, StepPlan
from axcore.errors import ConfigError


class _Step:
    """A plan being built: rows by sequence, the budget left, the sequences preempted."""

    def __init__(self, budget: int):
        self.budget = budget
        self.rows: dict[int, Row] = {}
        self.preempted: list[int] = []

    def add(self, seq: Sequence, count: int) -> None:
        start = seq.num_computed
        end = start + count
        self.rows[seq.seq_id] = Row(
            seq.seq_id, seq.request.request_id, seq.choice_index, seq.token_ids[start:end], start,
            list(seq.block_table), end == len(seq.token_ids))
        self.budget -= count

    def drop(self, seq: Sequence) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.budget += len(row.tokens)
        self.preempted.append(seq.seq_id)


class Scheduler:
    """Iteration-level batching over a paged KV cache (see the module docstring for the policy).

    `allocator` is owned by the scheduler from now on. `max_seqs` bounds the sequences
    running (and so the rows of a step), `max_tokens_per_step` the tokens of a step,
    `max_model_len` the known tokens of a sequence (prompt plus generated). A sampled token
    in `eos_token_ids` ends its sequence unless its request sets `ignore_eos`.
    """

    def __init__(self, allocator: BlockAllocator, *, max_seqs: int, max_tokens_per_step: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = ()):
        _check_limits(allocator, max_seqs, max_tokens_per_step, max_model_len)
        self.allocator = allocator
        self.max_seqs, self.max_tokens_per_step, self.max_model_len = max_seqs, max_tokens_per_step, max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._held: dict[str, list[Sequence]] = {}
        self._requests: dict[str, list[Sequence]] = {}
        self._seqs: dict[int, Sequence] = {}
        self._next_seq = 0
        self._next_order = 0
        self._prompt_tokens = self._generation_tokens = self._preemptions = 0

    # ---- requests in and out ----

    def add(self, request: GenerationRequest) -> list[int]:
        """Queue `request` as `params.n` sequences (their ids, by choice index).

        Refuses, naming the field, a request id already live, a prompt of `max_model_len`
        tokens or more ('prompt'), and a prompt plus `max_tokens` over `max_model_len`
        ('max_tokens').
        """
        rid, length, limit = request.request_id, len(request.prompt_token_ids), self.max_model_len
        if rid in self._requests:
            raise SamplingParamsError("request_id", f"{rid!r} is already running; give each live request its own id")
        if length >= limit:
            raise SamplingParamsError(
                "prompt", f"{length} tokens leave no room for a new one in the model's {limit}-token context; "
                f"shorten it to at most {limit - 1} tokens")
        if length + request.params.max_tokens > limit:
            raise SamplingParamsError(
                "max_tokens", f"{request.params.max_tokens} new tokens after a {length}-token prompt exceed the "
                f"model's {limit}-token context; ask for at most {limit - length}")
        seqs = [Sequence(self._next_seq + i, request, i, self._next_order) for i in range(request.params.n)]
        self._next_seq += len(seqs)
        self._next_order += 1
        self._requests[rid] = seqs
        self._seqs.update((seq.seq_id, seq) for seq in seqs)
        self._enqueue(seqs[0])
        if len(seqs) > 1:
            for seq in seqs[1:]:
                seq.status = SeqStatus.HELD
            self._held[rid] = seqs[1:]
        return [seq.seq_id for seq in seqs]

    def finish(self, target: int | str, reason: str) -> bool:
        """End a sequence (an int id) or every live sequence of a request (a str id) at once.

        Frees their blocks wherever they are (waiting, held, running, in a plan in flight:
        `finish_step` then ignores their rows). False if nothing live matched.
        """
        if isinstance(target, str):
            seqs = [seq for seq in self._requests.get(target, []) if seq.status is not SeqStatus.FINISHED]
        else:
            seqs = [self._seqs[target]] if target in self._seqs else []
        for seq in seqs:
            self._end(seq, reason)
        return bool(seqs)

    def abort(self, request_id: str) -> bool:
        """The client is gone: end every sequence of `request_id` with reason "abort"."""
        return self.finish(request_id, "abort")

    def sequence(self, seq_id: int) -> Sequence:
        """A live sequence, to read (its request, tokens and prompt length); KeyError if ended."""
        return self._seqs[seq_id]

    def has_unfinished(self) -> bool:
        """Whether any request is still live."""
        return bool(self._requests)

    def stats(self) -> SchedulerStats:
        """Current gauges and counters since construction."""
        return SchedulerStats(
            waiting=len(self._waiting) + sum(len(held) for held in self._held.values()),
            running=len(self._running), kv_blocks_used=self.allocator.num_used,
            kv_blocks_free=self.allocator.num_free, prefix_cache_queries=self.allocator.queries,
            prefix_cache_hits=self.allocator.hits, prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens, preemptions=self._preemptions)

    def reset_cache(self) -> None:
        """The KV cache's contents are stale (new weights): preempt every running sequence and drop the prefix cache.

        The preempted sequences keep their tokens and recompute them when readmitted (counted as
        preemptions); a plan in flight is then ignored by `finish_step` (its sequences no longer run).
        """
        for seq in list(self._running):
            self._release_blocks(seq)
            self._running.remove(seq)
            self._enqueue(seq)
            self._preemptions += 1
        self.allocator.clear_prefix_cache()

    # ---- one step ----

    def schedule(self) -> StepPlan:
        """Plan the next step: decodes, then prefill chunks, then admissions (module docstring)."""
        step = _Step(self.max_tokens_per_step)
        decoding = [seq for seq in self._running if seq.remaining == 1]
        prefilling = [seq for seq in self._running if seq.remaining > 1]
        for seq in decoding + prefilling:
            if seq.status is SeqStatus.RUNNING and step.budget > 0:
                count = min(seq.remaining, step.budget)
                if self._reserve(seq, seq.num_computed + count, step):
                    step.add(seq, count)
        if not step.preempted:
            self._admit(step)
        return StepPlan(rows=list(step.rows.values()), preempted=step.preempted)

    def finish_step(self, plan: StepPlan, sampled: dict[int, int]) -> list[SeqUpdate]:
        """Record that `plan` ran: its tokens are cached, `sampled` (seq id -> token) extends its samplers.

        `sampled` holds a token for every row with `sample` (rows of sequences ended since
        `schedule` are skipped, their tokens ignored). Newly full blocks are registered in
        the prefix cache; a sequence ends on a stop token ("stop"), on `max_tokens` or
        `max_model_len` ("length"), and its blocks are freed. Returns one update per token.
        """
        expected = {row.seq_id for row in plan.rows if row.sample}
        if set(sampled) - expected or expected - set(sampled) - self._ended(expected):
            raise RuntimeError(f"sampled tokens for {sorted(sampled)}, but the plan samples {sorted(expected)}")
        updates = []
        for row in plan.rows:
            seq = self._seqs.get(row.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            if row.start != seq.num_computed:
                raise RuntimeError(f"sequence {seq.seq_id}: a stale plan (row starts at {row.start}, "
                                   f"{seq.num_computed} tokens cached)")
            self._computed(seq, len(row.tokens))
            if row.sample:
                updates.append(self._append(seq, int(sampled[row.seq_id])))
        return updates

    # ---- helpers ----

    def _ended(self, seq_ids: set[int]) -> set[int]:
        return {i for i in seq_ids if i not in self._seqs or self._seqs[i].status is not SeqStatus.RUNNING}

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)

    def _reserve(self, seq: Sequence, end: int, step: _Step) -> bool:
        """Blocks for positions < `end` of running `seq`, preempting the latest arrivals; False if `seq` was."""
        needed = math.ceil(end / self.allocator.block_size) - len(seq.block_table)
        while self.allocator.num_free < needed:
            victim = self._running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        seq.block_table.extend(self.allocator.allocate() for _ in range(needed))
        return True

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        self._release_blocks(seq)
        self._running.remove(seq)
        self._enqueue(seq)
        step.drop(seq)
        self._preemptions += 1

    def _release_blocks(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.allocator.free(block)
        seq.block_table, seq.num_computed, seq.num_registered = [], 0, 0

    def _admit(self, step: _Step) -> None:
        """Admit waiting sequences in order while they fit (seats, budget, blocks)."""
        size, alloc = self.allocator.block_size, self.allocator
        while self._waiting and len(self._running) < self.max_seqs and step.budget > 0:
            seq = self._waiting[0]
            usable = seq.prompt_done or seq.choice_index > 0 or seq.request.params.prompt_logprobs is None
            keys = seq.block_keys((len(seq.token_ids) - 1) // size, size) if usable else []
            found = []
            for key in keys:
                block = alloc.cached(key)
                if block is None:
                    break
                found.append(block)
            start = len(found) * size
            count = min(len(seq.token_ids) - start, step.budget)
            needed = math.ceil((start + count) / size) - len(found)
            if needed + sum(alloc.refcount(block) == 0 for block in found) > alloc.num_free:
                return
            seq.block_table = alloc.match_prefix(keys)
            if seq.block_table != found:
                raise RuntimeError("the prefix cache changed between lookup and admission")
            seq.block_table.extend(alloc.allocate() for _ in range(needed))
            seq.num_computed, seq.num_registered = start, len(found)
            self._waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            bisect.insort(self._running, seq, key=lambda s: s.sort_key)
            step.add(seq, count)

    def _computed(self, seq: Sequence, count: int) -> None:
        """`count` more tokens of `seq` are cached: count prompt tokens, register full blocks, free siblings."""
        start = seq.num_computed
        seq.num_computed += count
        self._prompt_tokens += max(0, min(seq.num_computed, seq.num_prompt) - start)
        size = self.allocator.block_size
        full = seq.num_computed // size
        if full > seq.num_registered:
            keys = seq.block_keys(full, size)
            for i in range(seq.num_registered, full):
                self.allocator.register(seq.block_table[i], keys[i])
            seq.num_registered = full
        if not seq.prompt_done and seq.num_computed >= seq.num_prompt:
            seq.prompt_done = True
            self._release_siblings(seq)

    def _release_siblings(self, seq: Sequence) -> None:
        for sibling in self._held.pop(seq.request.request_id, []):
            self._enqueue(sibling)

    def _append(self, seq: Sequence, token: int) -> SeqUpdate:
        seq.token_ids.append(token)
        self._generation_tokens += 1
        params = seq.request.params
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._end(seq, reason)
        return SeqUpdate(seq.seq_id, seq.request.request_id, seq.choice_index, token, reason)

    def _end(self, seq: Sequence, reason: str) -> None:
        """Free `seq`'s blocks and forget it (held siblings of a first choice ending early run alone)."""
        rid = seq.request.request_id
        if seq.status is SeqStatus.HELD:
            self._held[rid].remove(seq)
        else:
            if seq.status is SeqStatus.RUNNING:
                self._running.remove(seq)
            elif seq.status is SeqStatus.WAITING:
                self._waiting.remove(seq)
            self._release_siblings(seq)
        self._release_blocks(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        del self._seqs[seq.seq_id]
        if all(s.status is SeqStatus.FINISHED for s in self._requests[rid]):
            del self._requests[rid]
            self._held.pop(rid, None)

def _check_limits(allocator: BlockAllocator, max_seqs: int, max_tokens_per_step: int, max_model_len: int) -> None:
    """Refuse limits under which a sequence could never finish or a decode could starve."""
    if max_seqs < 1:
        raise ConfigError(f"'max_seqs': must be at least 1, got {max_seqs}")
    if max_tokens_per_step < max_seqs:
        raise ConfigError(f"'max_tokens_per_step': {max_tokens_per_step} is below max_seqs {max_seqs}; every "
                          "running sequence needs a token per step: raise it or lower max_seqs")
    if max_model_len < 2:
        raise ConfigError(f"'max_model_len': must be at least 2, got {max_model_len}")
    blocks = math.ceil(max_model_len / allocator.block_size)
    if blocks > allocator.num_blocks - 1:
        raise ConfigError(f"'max_model_len': {max_model_len} tokens need {blocks} KV blocks of "
                          f"{allocator.block_size}, but the cache has {allocator.num_blocks - 1}; "
                          "lower max_model_len or give the cache more blocks")
