"""One held-out evaluation, used by the trainer and by `axcore eval`.

Loss = sum over every target of `target_weights * cross-entropy` / sum of `target_weights`
(nats per weighted target token) over the batches evaluated. Both sums are accumulated
on the device (float32 scalars, updated by one jitted step per batch) and fetched once,
at the end; `tokens` is the sum of the weights (the number of targets for 0/1 weights).

Which batches: the eval split's pipeline is one pass in order; padding rows carry zero
weight, so the tail of the last batch changes nothing. `max_batches` (the trainer's
`trainer.eval_batches`, `axcore eval --max-batches`) stops earlier; None or 0 evaluates
the whole split. In a multi-process job every process runs the same number of batches:
after each batch the processes agree on "all exhausted" (a small allgather).

Mixtures (`input.mixture`): every component is evaluated on its own, its split's rows
alone, so component `c` gets exactly the batches a run whose input is `c` alone would
evaluate. The budget is shared by weight: `component_budgets` splits `max_batches` in
proportion to the mixture weights (largest remainders, ties to the earlier component),
at least one batch each, taken from the largest share (so 8 batches at weights 3:1 are
6 and 2; a bound below the number of components evaluates one batch of each). No bound evaluates every
component's whole split. The total is token-weighted, `sum_c loss_c * tokens_c / sum_c
tokens_c` (the cross-entropy sums over the weight sums), and is what `eval/loss` logs;
`eval/loss/<name>` and `eval/tokens/<name>` log each component (`eval_metrics`).

Before training, `check_evaluable` refuses a run whose evaluations would find no held-out
document (`eval_fraction: 0`, or too few documents for it), naming the setting and the fix.

Progress: `run_evaluation` calls `progress(batches, tokens)` after each batch (host
counts only, no device sync); `EvalProgress` turns that into a line on stderr (or the
run's stream) every few seconds, once an evaluation has run for a few seconds.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from axcore.data import RandomAccessSource, Split, StreamedSource
from axcore.errors import ConfigError
from axcore.observe import format_duration
from axcore.placement.inputs import input_pipeline

# A streamed source is read (without tokenizing) this many documents far at most to find its first held-out one.
EVAL_CHECK_MAX_DOCUMENTS = 100_000


class NothingToEvaluateError(ConfigError):
    """`trainer.eval_every` evaluates, but a source holds out no document (the message names the fix)."""


@dataclasses.dataclass(frozen=True)
class EvalTotals:
    """The result of one evaluation (with a mixture: the token-weighted total, and each component)."""

    # Weighted mean cross-entropy, nats per target token (nan when no token counted).
    loss: float
    # Sum of the target weights counted (the number of target tokens for 0/1 weights).
    tokens: float
    # Batches evaluated.
    batches: int
    # Whether the whole split was read (False when max_batches stopped it first).
    complete: bool
    # Each mixture component's own evaluation, by name in the mixture's order ({} without a mixture).
    components: Mapping[str, EvalTotals] = dataclasses.field(default_factory=dict)


def accumulate_step(eval_step: Callable[[Any, dict], dict]) -> Callable:
    """`(params, batch, totals) -> totals`: adds a batch's `xent_sum` and `tokens` on the device.

    `eval_step(params, batch)` returns `{"xent_sum", "tokens"}` float scalars (the trainer's
    `_eval_step`); `totals` is a float32 `[2]` array (donated).
    """

    def step(params, batch, totals):
        out = eval_step(params, batch)
        return totals + jnp.stack([out["xent_sum"], out["tokens"]]).astype(jnp.float32)

    return step


def _all_exhausted(local: bool) -> bool:
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return bool(np.all(np.asarray(multihost_utils.process_allgather(np.int32(local)))))


def run_evaluation(step: Callable, params: Any, loaded: Iterable[Any], max_batches: int | None,
                   progress: Callable[[int, int], None] | None = None) -> EvalTotals:
    """Evaluates `params` on `loaded` (`LoadedBatch`es: `.batch` on devices, `.exhausted`, `.tokens`).

    `step` is `jax.jit(accumulate_step(...))`. Stops when every process's pipeline is
    exhausted, at the end of `loaded`, or after `max_batches` (None or 0: no bound).
    `progress(batches, tokens)` is called after each batch with the batches dispatched and
    this process's non-padding tokens read so far (host counts; nothing waits for the device).
    """
    totals = jnp.zeros((2,), jnp.float32)
    batches, read, complete = 0, 0, False
    iterator = iter(loaded)
    while True:
        if max_batches and batches == max_batches:
            break
        try:
            item = next(iterator)
        except StopIteration:
            complete = True
            break
        totals = step(params, item.batch, totals)
        batches += 1
        read += int(getattr(item, "tokens", 0))
        if progress is not None:
            progress(batches, read)
        if _all_exhausted(bool(getattr(item, "exhausted", False))):
            complete = True
            break
    xent, tokens = (float(x) for x in jax.device_get(totals))
    return EvalTotals(xent / tokens if tokens > 0 else float("nan"), tokens, batches, complete)


def component_budgets(weights: Sequence[float], max_batches: int | None) -> list[int]:
    """Batches per mixture component: `max_batches` split by `weights` (module docstring); 0 = no bound.

    Largest remainders on exact fractions: component i gets floor(B w_i / W), and the
    batches left go one each to the largest fractional parts (ties: the earlier one).
    A component left with none takes one from the largest budget (the earlier one), so
    the budgets sum to B when B >= the number of components; below it, each gets 1.
    None or 0: `[0] * len(weights)` (whole splits).
    """
    if not max_batches:
        return [0] * len(weights)
    exact = [Fraction(w) for w in weights]
    quotas = [max_batches * w / sum(exact) for w in exact]
    budgets = [int(q) for q in quotas]  # Floors (the quotas are non-negative).
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - budgets[i]), i))
    for i in by_remainder[: max_batches - sum(budgets)]:
        budgets[i] += 1
    if max_batches < len(budgets):
        return [1] * len(budgets)
    for i in [i for i, b in enumerate(budgets) if b == 0]:
        budgets[budgets.index(max(budgets))] -= 1
        budgets[i] = 1
    return budgets


def combine(components: Mapping[str, EvalTotals]) -> EvalTotals:
    """The token-weighted total of the components' evaluations, holding them as `components`."""
    tokens = sum(c.tokens for c in components.values())
    xent = sum(c.loss * c.tokens for c in components.values() if c.tokens > 0)
    return EvalTotals(
        xent / tokens if tokens > 0 else float("nan"), tokens, sum(c.batches for c in components.values()),
        all(c.complete for c in components.values()), dict(components),
    )


class Evaluator:
    """Held-out evaluation of a placed model under an objective: the eval step and the loop over a loader.

    `Evaluator(placement, objective)` is what `axcore eval` builds (no learner, no optimizer
    state) and what the train step holds; `evaluate_input` takes either.
    """

    def __init__(self, placement: Any, objective: Any):
        """`placement`: an `axcore.placement.Placement`; `objective`: its `eval_sums(model, params, batch)`."""
        self.placement = placement
        self.objective = objective
        self.cfg = placement.cfg
        self.tokenizer = placement.tokenizer
        self.shard_layout = placement.shard_layout
        self.loader = placement.loader

    def eval_step(self, params: dict, batch: dict) -> dict:
        """`{"xent_sum", "tokens"}` of one held-out batch (the objective's `eval_sums`; not jitted)."""
        with self.placement.op_environment():
            return self.objective.eval_sums(self.placement.model, params, batch)

    def compiled_eval_step(self):
        """`(params, batch, totals) -> totals`, jitted: adds a batch's weighted cross-entropy and weights on device."""
        return jax.jit(
            accumulate_step(self.eval_step),
            in_shardings=(self.placement.param_shardings, self.placement.batch_sharding, None),
            donate_argnums=2,
        )

    def evaluate(self, params: dict, loader: Any, max_batches: int | None, *, eval_step: Any = None,
                 progress: Any = None) -> EvalTotals:
        """Held-out loss of `params` over `loader`'s batches, at most `max_batches` (None or 0: all); closes
        `loader`. `eval_step`: a `compiled_eval_step()` to reuse; `progress`: called `(batches, tokens)` after
        each batch."""
        eval_step = eval_step or self.compiled_eval_step()
        try:
            return run_evaluation(eval_step, params, loader, max_batches, progress)
        finally:
            loader.close()


def evaluate_input(
    train_step: Any, params: Any, split: Split, max_batches: int | None, *, eval_step: Any = None,
    progress: Callable[[str | None, int], Callable[[int, int], None] | None] | None = None,
) -> EvalTotals:
    """`params` on `split` of the experiment's input: one stream, or each mixture component alone.

    `train_step` is an `Evaluator` or the `TrainStep` (its config, tokenizer, shard layout,
    `loader` and `evaluate`). `max_batches` bounds the whole evaluation (split across a mixture's
    components by `component_budgets`); None or 0 reads every split in full.
    `progress(component, budget)` returns the per-batch callback of one stream (the
    component's name, None without a mixture) or None.
    """
    cfg = train_step.cfg
    vocab = cfg.model.vocab_size if "vocab_size" in cfg.model.keys() else None
    layout = train_step.shard_layout

    def one(component: str | None, budget: int | None) -> EvalTotals:
        pipeline = input_pipeline(cfg.input, split, train_step.tokenizer, vocab, layout, component=component)
        where = "The eval split's batch" if component is None else f"The eval split's batch of input.mixture '{component}'"
        tick = progress(component, budget) if progress is not None else None
        return train_step.evaluate(params, train_step.loader(pipeline, where), budget, eval_step=eval_step,
                                   progress=tick)

    if cfg.input.mixture is None:
        return one(None, max_batches)
    names = [c.name for c in cfg.input.mixture]
    budgets = component_budgets([c.weight for c in cfg.input.mixture], max_batches)
    return combine({name: one(name, budget) for name, budget in zip(names, budgets)})


def first_eval_document(eval_fraction: float) -> int:
    """The index of the first held-out document under `axcore.data.sources.is_eval_document` (f > 0)."""
    k = max(0, math.ceil(1 / eval_fraction) - 1)
    while math.floor((k + 1) * eval_fraction) <= math.floor(k * eval_fraction):  # Float rounding of 1 / f.
        k += 1
    while k > 0 and math.floor(k * eval_fraction) > math.floor((k - 1) * eval_fraction):
        k -= 1
    return k


def check_evaluable(config: Any, tokenizer: Any = None) -> None:
    """Refuses a config whose evaluations during training would find nothing to evaluate.

    With `trainer.eval_every` > 0, every source (each mixture component) must hold out at
    least one document: `eval_fraction` > 0, and enough documents for the held-out rule
    to pick one (random-access sources count them; streamed sources are read, without
    tokenizing, up to the first held-out document, at most EVAL_CHECK_MAX_DOCUMENTS
    documents, beyond which the run finds out at its first evaluation).

    Raises:
        NothingToEvaluateError: naming `<source path>.eval_fraction` and `trainer.eval_every`.
        DataError: the source's data cannot be read (missing files, ...).
    """
    every = config.trainer.eval_every
    if not every:
        return
    fix = "set trainer.eval_every: 0 (and evaluate afterwards with axcore eval RUN --data FILE)"
    for _, _, source in config.input.sources(tokenizer):
        where, fraction = source.where, source.config.eval_fraction
        if fraction <= 0:
            raise NothingToEvaluateError(
                f"trainer.eval_every={every} evaluates on held-out documents, but {where}.eval_fraction is 0: "
                f"{source.describe()} holds none out; {fix}, or raise {where}.eval_fraction."
            )
        first = first_eval_document(fraction)
        if isinstance(source, RandomAccessSource):
            count = source.num_documents()
        elif isinstance(source, StreamedSource) and first < EVAL_CHECK_MAX_DOCUMENTS:
            count = sum(1 for _ in itertools.islice(source.raw_documents(), first + 1))
        else:
            continue
        if count <= first:
            raise NothingToEvaluateError(
                f"trainer.eval_every={every} evaluates on held-out documents, but {where} ({source.describe()}) "
                f"holds {count} document(s), too few for {where}.eval_fraction={fraction} to hold one out (it "
                f"takes {first + 1}); {fix}, raise {where}.eval_fraction, or add documents."
            )


def eval_metrics(totals: EvalTotals, prefix: str = "eval") -> dict[str, float]:
    """`{prefix}/loss` and `{prefix}/tokens` (the total), and `{prefix}/loss/<name>`, `{prefix}/tokens/<name>`
    for each mixture component."""
    out = {f"{prefix}/loss": totals.loss, f"{prefix}/tokens": totals.tokens}
    for name, part in totals.components.items():
        out[f"{prefix}/loss/{name}"], out[f"{prefix}/tokens/{name}"] = part.loss, part.tokens
    return out


def _batches(n: int) -> str:
    return f"{n} batch{'' if n == 1 else 'es'}"


def describe(totals: EvalTotals, bound: str) -> str:
    """What an evaluation measured, for one console line; `bound` names the setting of the budget.

    "held-out loss 5.1234 over 16,384 tokens (8 batches, whole split)", or with a mixture
    "held-out loss 5.3700 over 16,384 tokens: man 4.9800 over 12,288 tokens (6 batches),
    docs 6.5100 over 4,096 tokens (2 batches, whole split); trainer.eval_batches=8 split by weight".
    """
    def part(t: EvalTotals) -> str:
        return f"over {t.tokens:,.0f} tokens ({_batches(t.batches)}{', whole split' if t.complete else ''})"

    if not totals.components:
        return f"held-out loss {totals.loss:.4f} {part(totals)}" + ("" if totals.complete else f"; {bound}")
    parts = ", ".join(f"{name} {t.loss:.4f} {part(t)}" for name, t in totals.components.items())
    split = "" if totals.complete else f"; {bound} split by weight"
    return f"held-out loss {totals.loss:.4f} over {totals.tokens:,.0f} tokens: {parts}{split}"


class EvalProgress:
    """Progress lines of long evaluations: `for_stream(component, budget)` is `evaluate_input`'s `progress`.

    A line (batches done of the budget, tokens read, time, ETA when bounded) goes to
    `stream` once a stream has run `first_after` seconds, then every `every` seconds
    (and at the last batch of a bounded stream that showed one); nothing for a quick evaluation.
    `clock` (seconds, monotonic) is replaceable for tests. `on_batch` is called after
    every batch (the trainer beats its watchdog there).
    """

    def __init__(self, stream: TextIO | None = None, label: str = "eval", *, first_after: float = 5.0,
                 every: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 on_batch: Callable[[], None] | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.label, self.first_after, self.every = label, first_after, every
        self.clock, self.on_batch = clock, on_batch

    def for_stream(self, component: str | None, budget: int | None) -> Callable[[int, int], None]:
        """The per-batch callback `(batches, tokens)` of one stream (a component, or None: the only one)."""
        name = self.label if component is None else f"{self.label} {component}"
        started = self.clock()
        state = {"shown": None}

        def tick(batches: int, tokens: int) -> None:
            if self.on_batch is not None:
                self.on_batch()
            now = self.clock()
            elapsed = now - started
            last = budget and batches >= budget
            due = elapsed >= self.first_after and (state["shown"] is None or now - state["shown"] >= self.every)
            if not (due or (last and state["shown"] is not None)):
                return
            state["shown"] = now
            of = f"{batches}/{budget}" if budget else f"{batches} (whole split)"
            eta = f", ETA {format_duration(elapsed / batches * (budget - batches))}" if budget else ""
            print(f"{name}: batch {of}, {tokens:,} tokens read, {format_duration(elapsed)} elapsed{eta}",
                  file=self.stream, flush=True)

        return tick


__all__ = ["EvalProgress", "EvalTotals", "Evaluator", "NothingToEvaluateError", "check_evaluable", "accumulate_step", "combine", "component_budgets", "describe",
           "eval_metrics", "evaluate_input", "run_evaluation"]
