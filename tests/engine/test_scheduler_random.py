"""Scheduler, at random: hypothesis interleaves add, step, abort (also mid-step) and finish on small caches.

After every step the driver checks: reference counts equal the live tables holding each
block; a block in two live tables is one computed full block of one prefix; a step stays
within `max_seqs` and the token budget; each sequence feeds its known tokens at
consecutive positions, once per (re)computation, restarting only at a whole cached block;
every context read back through the block tables holds the right prefix; each choice's
tokens follow the prompt decoded alone. At the end every request drains and no block is
used.
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from scheduler_driver import Driver

from axcore.engine.blocks import BlockAllocator
from axcore.engine.requests import GenerationRequest, SamplingParams
from axcore.engine.scheduler import Scheduler

# Few distinct heads, so that prompts share prefixes and hit the cache.
HEADS = [(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 8, 7, 6, 5, 4)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 14), block_size=st.sampled_from([1, 2, 4]),
                max_seqs=st.integers(1, 4), extra_budget=st.integers(0, 8), eos=st.sampled_from([(), (0,), (7, 50)]))
    def setup(self, num_blocks, block_size, max_seqs, extra_budget, eos):
        max_model_len = max(2, min((num_blocks - 1) * block_size, 24))
        alloc = BlockAllocator(num_blocks, block_size)
        sched = Scheduler(alloc, max_seqs=max_seqs, max_tokens_per_step=max_seqs + extra_budget,
                          max_model_len=max_model_len, eos_token_ids=eos)
        self.driver = Driver(sched, eos)
        self.count = 0

    @rule(head=st.sampled_from(HEADS), tail=st.lists(st.integers(0, 96), max_size=6), n=st.integers(1, 3),
          max_tokens=st.integers(1, 8), adapter=st.sampled_from([None, None, "lora"]),
          ignore_eos=st.booleans(), prompt_logprobs=st.sampled_from([None, None, 0]))
    def add(self, head, tail, n, max_tokens, adapter, ignore_eos, prompt_logprobs):
        limit = self.driver.sched.max_model_len
        prompt = (list(head) + tail)[:limit - 1] or [1]
        params = SamplingParams(n=n, max_tokens=min(max_tokens, limit - len(prompt)), ignore_eos=ignore_eos,
                                prompt_logprobs=prompt_logprobs)
        self.count += 1
        self.driver.add(GenerationRequest(f"r{self.count}", prompt, params, adapter=adapter))

    @precondition(lambda self: self.driver.live)
    @rule()
    def step(self):
        self.driver.step()

    @precondition(lambda self: self.driver.live)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        live = sorted({request.request_id for request, _ in self.driver.live.values()})
        self.driver.end(live[pick % len(live)], "abort")

    @precondition(lambda self: self.driver.live)
    @rule(pick=st.integers(0, 1000))
    def abort_during_a_step(self, pick):
        plan = self.driver.plan()
        if plan.rows:
            self.driver.end(plan.rows[pick % len(plan.rows)].request_id, "abort")
        self.driver.run(plan)

    @precondition(lambda self: any(self.driver.outputs[req.request_id, c] for req, c in self.driver.live.values()))
    @rule(pick=st.integers(0, 1000))
    def stop_string(self, pick):
        started = sorted(s for s, (req, c) in self.driver.live.items() if self.driver.outputs[req.request_id, c])
        self.driver.end(started[pick % len(started)], "stop")

    @invariant()
    def consistent(self):
        if hasattr(self, "driver"):
            self.driver.check_state()

    def teardown(self):
        if hasattr(self, "driver"):
            self.driver.drain()


SchedulerMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
test_scheduler_state_machine = SchedulerMachine.TestCase
