"""`Engine`: continuous batching over a paged KV cache, the scheduler, model runner and sampler joined.

    engine = Engine(model, params, tokenizer, config=EngineConfig(num_blocks=512, max_seqs=16))
    outputs = engine.generate([GenerationRequest("a", prompt_ids, SamplingParams(max_tokens=32))])
    async for output in engine.stream(request): ...     # the EngineClient protocol (axcore serve)

One `step()` is: the scheduler plans the rows (`Scheduler.schedule`); they are packed
into the runner's arrays (`axcore.engine.batch`); one model call (`ModelRunner.step`, all
tokens' logits only when a row computes prompt log-probabilities), or several: the decode rows
in one and the prefill chunks grouped into the calls that pad least (`batch.split_calls`: no
decode row padded to a long chunk, no short chunk padded to a long one). With ragged steps
(`EngineConfig.ragged_steps`, on by default where the paged attention kernel reads blocks in
place) a step is one call of one token per row (`batch.pack_ragged`), logits computed for the
rows that sample only; the sampler draws a
token for every row that ends at its sequence's last known token (`sampling.sample`,
each row with its own parameters and key); the scheduler records the step
(`finish_step`: blocks registered, sequences ended on stop tokens and lengths); each
request's outputs are updated (`RequestState`: text, stop strings, log-probabilities).

Threads: `step` may run in a background thread (`stream` starts one, `EngineDriver`)
while `add_request`, `abort` and `update_weights` come from others. One lock guards the
scheduler and the requests' states; it is released during the model call and the draw,
so an abort waits for at most the bookkeeping of a step (the scheduler drops rows of
sequences ended while their step was in flight). Steps themselves run one at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import jax
import numpy as np

from axcore.data.tokenizer import Tokenizer
from axcore.engine import batch as packing
from axcore.engine.adapters import check_names
from axcore.engine.blocks import BlockAllocator
from axcore.engine.config import EngineConfig, EngineError, resolve
from axcore.engine.driver import EngineDriver, stream_outputs
from axcore.engine.model_runner import ModelRunner
from axcore.engine.outputs import RequestState
from axcore.engine.requests import EngineStats, GenerationRequest, RequestOutput, SamplingParamsError
from axcore.engine.sampling import SamplingBatch, prompt_scores, sample, top_logprobs_bucket
from axcore.engine.scheduler import Scheduler
from axcore.engine.sequence import StepPlan


class Engine:
    """An inference engine over one model and its parameters (module docstring).

    Args:
        model: a causal LM with `init_paged_cache` / `extend_paged` (`axcore.layers.CausalLM`).
        params: its parameter tree (used in place, never copied).
        tokenizer: decodes the outputs' text (None: outputs carry token ids only, stop strings refused).
        config: cache, batching and compilation settings (None: `EngineConfig()`).
        eos_token_ids: tokens that end a choice unless its request sets `ignore_eos`.
        name: the base model's name (`model_names()`).
        adapters: names of the adapters `params` stacks (slot i + 1 = the i-th; `axcore.engine.adapters`),
            which requests select by `adapter`; empty: the base only.
    """

    def __init__(self, model: Any, params: Any, tokenizer: Tokenizer | None = None, *,
                 config: EngineConfig | None = None, eos_token_ids: Sequence[int] = (), name: str = "model",
                 adapters: Sequence[str] = ()):
        self.model, self.params, self.tokenizer, self.name = model, params, tokenizer, name
        # Adapter name -> its slot in the stacked parameters (1..N; 0 is the base).
        self.adapter_slots = {a: i + 1 for i, a in enumerate(check_names(name, adapters))}
        self.config = config = config or EngineConfig()
        # Token ids a prompt may hold: 0..vocab_size-1.
        self.vocab_size = int(model.config.vocab_size)
        # The settings in effect (None fields of `config` filled in): num_blocks, max_model_len, buckets.
        self.settings = resolve(model, config)
        s = self.settings
        self.runner = ModelRunner(model, num_blocks=s.num_blocks, block_size=config.block_size,
                                  batch_buckets=s.batch_buckets, token_buckets=s.token_buckets,
                                  ragged_buckets=s.ragged_buckets, max_programs=config.max_programs,
                                  kernels=config.kernels)
        # Whether steps run ragged (one token per row); `EngineConfig.ragged_steps`.
        in_place = config.ragged_steps is not False and self.runner.decode_reads_blocks_in_place(params)
        self.ragged_steps = in_place if config.ragged_steps is None else bool(config.ragged_steps)
        if self.ragged_steps and in_place:
            self.runner.widen_ragged_tables()  # A wide table costs nothing there; fewer programs to compile.
        self.scheduler = Scheduler(BlockAllocator(s.num_blocks, config.block_size), max_seqs=config.max_seqs,
                                   max_tokens_per_step=config.max_tokens_per_step, max_model_len=s.max_model_len,
                                   eos_token_ids=tuple(eos_token_ids))
        self._states: dict[str, RequestState] = {}
        self._arrivals = itertools.count()
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        self._sample = jax.jit(sample)
        self._prompt_scores = jax.jit(prompt_scores, static_argnames=("k",))
        self.driver = EngineDriver(self)

    # ---- requests ----

    def add_request(self, request: GenerationRequest,
                    sink: Callable[[RequestOutput | BaseException], None] | None = None) -> None:
        """Queues `request`; the next steps run it. `sink` receives each of its new outputs.

        Raises SamplingParamsError (naming the field) for a request the engine cannot serve: an
        id already live, too long a prompt, an adapter it does not hold, stop strings without a tokenizer.
        """
        if request.adapter is not None and request.adapter not in self.adapter_slots:
            if not self.adapter_slots:
                raise SamplingParamsError("model", f"no adapter {request.adapter!r}: this engine serves only "
                                          f"{self.name!r}; ask for it by that name")
            raise SamplingParamsError("model", f"no adapter {request.adapter!r}: this engine serves "
                                      f"{', '.join(map(repr, self.model_names()))}; ask for one of those")
        if request.params.stop and self.tokenizer is None:
            raise SamplingParamsError("stop", "this engine has no tokenizer to match stop strings; "
                                      "use stop_token_ids")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise SamplingParamsError("prompt", f"token ids must lie in 0..{vocab - 1} (the model's vocabulary)")
        with self._lock:
            self.scheduler.add(request)
            self._states[request.request_id] = RequestState(request, next(self._arrivals), self.tokenizer, sink)
        self.driver.wake()

    def abort(self, request_id: str) -> bool:
        """Ends a live request's choices with "abort" (its blocks are freed now); False if not live."""
        with self._lock:
            state = self._states.pop(request_id, None)
            if state is None:
                return False
            self.scheduler.abort(request_id)
            state.end("abort")
            output = state.snapshot()
        if state.sink is not None:
            state.sink(output)
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is live."""
        with self._lock:
            return bool(self._states)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[RequestOutput]:
        """Runs `requests` (with any others live) until they all finish; their final outputs, in order.

        A request refused (`add_request`) refuses them all: none is left running."""
        added = []
        try:
            for request in requests:
                self.add_request(request)
                added.append(request.request_id)
        except Exception:
            for rid in added:  # All or none: a refused request leaves no other running.
                self.abort(rid)
            raise
        states = [self._states[r.request_id] for r in requests]
        while not all(state.finished for state in states):
            self.step()
        return [state.output for state in states]

    def stream(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of `request` after each step that changed it, the last one `finished` (EngineClient).

        A background thread drives the steps while requests are live; closing the iterator
        early aborts the request.
        """
        return stream_outputs(self, request)

    def model_names(self) -> list[str]:
        """The base model's name, then each resident adapter's."""
        return [self.name, *self.adapter_slots]

    def stats(self) -> EngineStats:
        """Scheduler gauges and counters, and the compiled programs."""
        with self._lock:
            s = self.scheduler.stats()
        return EngineStats(**dataclasses.asdict(s), compiled_programs=self.runner.num_programs,
                           compiled_programs_cap=self.runner.max_programs)

    def update_weights(self, params: Any) -> None:
        """The next step runs on `params` (same tree structure, shapes, dtypes and shardings, else EngineError).

        The KV cache is stale: every running sequence is preempted (recomputed on the new
        parameters, its tokens kept) and the prefix cache dropped.
        """
        check_same_tree(self.params, params)
        with self._lock:
            self.params = params
            self.scheduler.reset_cache()

    def precompile(self) -> list[tuple[int, int, int, bool, int | None]]:
        """Compiles, without running, the step program of every ragged row bucket (`ModelRunner.precompile_ragged`,
        tables of the narrowest ragged width), as a server does before it takes requests; returns the program
        keys compiled now. An engine without ragged steps compiles nothing here (its programs are one per
        batch, token and table-width bucket: too many to compile ahead)."""
        if not self.ragged_steps:
            return []
        with self._step_lock:
            return self.runner.precompile_ragged(self.params)

    def close(self) -> None:
        """Stops the background thread (live requests stay; `step` still runs them)."""
        self.driver.stop()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Runs one engine step (module docstring); returns the outputs it changed (none if idle)."""
        with self._step_lock:
            with self._lock:
                plan = self.scheduler.schedule()
                if not plan.rows:
                    return []
                if self.ragged_steps and not self._asks_prompt_logprobs(plan):
                    parts, inputs = [plan], [self._inputs(plan, ragged=True)]
                else:
                    parts = packing.split_calls(plan, self._call_cost) if self.config.split_mixed_steps else [plan]
                    inputs = [self._inputs(part) for part in parts]
            results = [self._run(part_inputs) for part_inputs in inputs]
            with self._lock:
                return [output for part, part_inputs, result in zip(parts, inputs, results)
                        for output in self._record(part, part_inputs, *result)]

    def _call_cost(self, rows: int, tokens: int, width: int) -> float:
        """The cost `batch.split_calls` weighs, in positions, of a model call of `rows` rows, a longest chunk
        of `tokens` and a widest block table of `width` blocks, padded to the runner's buckets."""
        batch, length, blocks = self.runner.padded_shape(rows, tokens, width)
        return batch * length + batch * blocks * packing.BLOCK_COST_TOKENS + packing.CALL_COST_TOKENS

    def _asks_prompt_logprobs(self, plan: StepPlan) -> bool:
        """Whether a row of `plan` computes prompt tokens whose log-probabilities were asked."""
        return any(packing.needs_prompt_logprobs(row, self.scheduler.sequence(row.seq_id)) for row in plan.rows)

    def _inputs(self, plan: StepPlan, ragged: bool = False) -> dict[str, Any]:
        """Everything the model call and the draw need, read from the sequences under the lock (`ragged`: one
        token per row, `batch.pack_ragged`; no row may need prompt log-probabilities)."""
        seqs = [self.scheduler.sequence(row.seq_id) for row in plan.rows]
        adapters = np.array([self.adapter_slots.get(seq.request.adapter, 0) for seq in seqs], np.int32)
        logit_rows = None
        if ragged:
            arrays, logit_rows, owner = packing.pack_ragged(plan.rows)
            targets, wanted, adapters = None, [[] for _ in plan.rows], adapters[owner]
            rows = self.runner.padded_shape(len(owner), 1, arrays[3].shape[1], ragged=True)[0]
            size = self.runner.logit_rows_bucket(rows)  # The logit rows, padded as the runner pads them.
        else:
            arrays = packing.pack_rows(plan.rows)
            targets, wanted = packing.prompt_targets(plan.rows, seqs, arrays[0].shape[1])
            size = self.runner.padded_shape(*arrays[0].shape, arrays[3].shape[1])[0]
        indices = [self._states[seq.request.request_id].index for seq in seqs]
        samplers = packing.sampling_rows(plan.rows, seqs, indices)
        penalties = packing.has_penalty(seqs)
        asked = [seq.request.params.prompt_logprobs for seq, positions in zip(seqs, wanted) if positions]
        return {"arrays": arrays, "targets": targets, "wanted": wanted, "params": self.params,
                "prompt_top": top_logprobs_bucket(max(asked, default=0)), "logit_rows": logit_rows,
                "sampling": SamplingBatch.build(samplers, engine_seed=self.config.seed, size=size),
                "history": packing.history(seqs, size) if penalties else None, "adapters": adapters,
                "tops": [0 if s is None else s.params.logprobs or 0 for s in samplers]}

    def _run(self, inputs: dict[str, Any]):
        """The model call and the draw (no lock held): host arrays of tokens, log-probabilities, and the
        prompt's `(log-probabilities [B, T], top ids [B, T, K], their log-probabilities [B, T, K])` (or None)."""
        all_logits = any(inputs["wanted"])
        out = self.runner.step(inputs["params"], *inputs["arrays"], adapters=inputs["adapters"], all_logits=all_logits,
                               logit_rows=inputs["logit_rows"])
        prompt_lps = None
        if all_logits:
            out, every = out
            targets = np.pad(inputs["targets"], [(0, every.shape[0] - inputs["targets"].shape[0]),
                                                 (0, every.shape[1] - inputs["targets"].shape[1])])
            prompt_lps = tuple(np.asarray(x) for x in self._prompt_scores(every, targets, k=inputs["prompt_top"]))
        history = inputs["history"]
        result = self._sample(out, inputs["sampling"], *(() if history is None else history))
        return (*(np.asarray(x) for x in result), prompt_lps)

    def _record(self, plan, inputs, tokens, logprobs, top_ids, top_lps, prompt_lps) -> list[RequestOutput]:
        """The scheduler's `finish_step` and the requests' outputs (under the lock); delivers them."""
        self._record_prompt(plan, inputs, prompt_lps)
        sampled = {row.seq_id: int(tokens[i]) for i, row in enumerate(plan.rows) if row.sample}
        row_of = {row.seq_id: i for i, row in enumerate(plan.rows)}
        changed: dict[str, RequestState] = {}
        for update in self.scheduler.finish_step(plan, sampled):
            state = self._states.get(update.request_id)
            if state is None:
                continue
            i = row_of[update.seq_id]
            count = inputs["tops"][i]
            top = {int(t): float(v) for t, v in zip(top_ids[i, :count], top_lps[i, :count])}
            if state.add_token(update.choice_index, update.new_token, update.finish_reason, logprobs[i], top):
                self.scheduler.finish(update.seq_id, "stop")
            changed[update.request_id] = state
        outputs = []
        for rid, state in changed.items():
            outputs.append(state.snapshot())
            if state.finished:
                del self._states[rid]
            if state.sink is not None:
                state.sink(outputs[-1])
        return outputs

    def _record_prompt(self, plan, inputs, prompt) -> None:
        """Stores the prompt log-probabilities (and top-N) a step computed in their requests' states."""
        for i, positions in enumerate(inputs["wanted"]):
            state = self._states.get(plan.rows[i].request_id)
            if not positions or state is None:
                continue
            lps, top_ids, top_lps = prompt
            count = state.request.params.prompt_logprobs
            for position in positions:
                column = position - 1 - plan.rows[i].start  # The logits at p - 1 predict the token at p.
                state.prompt_logprobs[position] = float(lps[i, column])
                state.prompt_top_logprobs[position] = {
                    int(t): float(v) for t, v in zip(top_ids[i, column, :count], top_lps[i, column, :count])}

    def fail(self, error: BaseException) -> None:
        """Hands `error` to every live request's sink and aborts them (the driver, on a failed step)."""
        with self._lock:
            states = list(self._states.values())
            for state in states:
                self.scheduler.abort(state.request.request_id)
            self._states.clear()
        for state in states:
            if state.sink is not None:
                state.sink(error)


def _same_placement(a: Any, b: Any) -> bool:
    """Whether two leaves lie alike: equal or equivalent shardings (a restored `P(None, None)` is a jitted update's
    `P()`: the same devices and layout), or neither sharded."""
    sa, sb = getattr(a, "sharding", None), getattr(b, "sharding", None)
    if sa is None or sb is None:
        return sa is sb
    return sa == sb or sa.is_equivalent_to(sb, np.ndim(a))


def check_same_tree(old: Any, new: Any) -> None:
    """EngineError unless `new` has `old`'s tree structure and, leaf by leaf, shape, dtype and sharding."""
    if jax.tree.structure(old) != jax.tree.structure(new):
        raise EngineError("update_weights: the new parameter tree's structure differs from the engine's; "
                          "pass the same model's parameters")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new)):
        where = jax.tree_util.keystr(path)
        same = (np.shape(a), getattr(a, "dtype", None)) == (np.shape(b), getattr(b, "dtype", None))
        if not same or not _same_placement(a, b):
            raise EngineError(f"update_weights: parameter {where} is {np.shape(b)} {getattr(b, 'dtype', None)} "
                              f"{getattr(b, 'sharding', None)}, the engine's is {np.shape(a)} "
                              f"{getattr(a, 'dtype', None)} {getattr(a, 'sharding', None)}; pass parameters "
                              "of the same shapes, dtypes and shardings")
