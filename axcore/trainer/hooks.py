"""Hooks of the training loop: what runs at a step, a metrics fetch, an evaluation, the end of a run.

The loop (`axcore.trainer.trainer.Trainer`) is a generator of dispatched steps; all it
does around them is call hooks. A hook is any object with some of these methods, each
given the run's public view (`RunView`):

- `on_run_start(run)`: once before the first step (`run.start_step` is known).
- `next_batch(run) -> LoadedBatch | None`: before each step is dispatched, with
  `run.state` the train state that step updates (the last dispatched step's, live on
  the devices) and `run.loader` the device loader: the step's batch (an
  `axcore.data.device_loader.LoadedBatch` whose `batch` the train step accepts and
  whose `state` is the input pipeline's position after the data it used), or None to
  leave it to the next hook and finally to the loader (`next(run.loader)`). The first
  hook that returns one wins. A stage that makes the step's batch from the live
  parameters (rollouts) or reuses one batch for several steps implements it.
- `on_step(run)`: after step `run.step` is dispatched, every `every` steps (the hook's
  `every` attribute, an int; absent or 1: every step). `run.step_metrics` are that
  step's metrics still on the device: reading one (`float(...)`) waits for the step.
- `wants_fetch(run) -> bool`: whether the metrics of `run.step` must be read back now
  (the loop fetches when any hook says so: `trainer.log_every`, evaluation, saving).
- `on_fetch(run)`: the metrics were read back; `run.metrics` is the record being built
  (`train/...` floats); a hook may add to it.
- `on_eval(run)`: after an evaluation at this fetch; `run.eval` holds its totals
  (`EvalTotals`: loss in nats per token) and `run.metrics` its `eval/...` values.
- `on_record(run)`: the record is complete (written, then the step saved).
- `on_run_end(run)`: once after the last step (checkpoints written, writers closed).
- `on_run_stopped(run, error)`: instead, when the loop ends early (Ctrl-C, an error).

Each phase calls the hooks in order: the loop's own hooks, then `Trainer.callbacks`.
Hooks come from the `loop_hooks` registry (`axcore_register_loop_hooks`): each entry
is a factory called with no argument when the `Trainer` is built; the built-ins
(axcore/trainer/plugin.py) register the loop's own hooks (`LOOP_HOOKS`: the watchdog
beat, the metrics fetch, progress, evaluation, metric writing, checkpointing, the
interrupt check) and its default callbacks (the loss plot, the end-of-run sample), and a
plugin registers its own the same way; they follow the built-ins in plugin order. A
hook registered under a name of `LOOP_HOOKS` is one of the loop's own: it runs first,
whatever the `callbacks` a `Trainer` is given.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from axcore.errors import one_line

if TYPE_CHECKING:
    from axcore.observe import MultiWriter, ProgressLog
    from axcore.placement.evaluate import EvalTotals
    from axcore.trainer.step import TrainStep
    from axcore.trainer.watchdog import Watchdog

# Registry names of the loop's own hooks, in the order they run (registered by axcore/trainer/plugin.py).
LOOP_HOOKS = ("watchdog", "fetch", "progress", "evaluation", "metrics_log", "checkpoint", "interrupt")

# `RunView.results` key of the end-of-run sample's text (the loop's `TrainResult.sample`).
SAMPLE = "sample"


@dataclasses.dataclass
class RunView:
    """What every hook gets: the run as the loop sees it, public pieces only (module docstring)."""

    # The experiment's config tree (`config.trainer`, `config.input`, `config.model` ...).
    config: Any
    # The run directory (config.yaml, metrics, checkpoints/).
    run_dir: pathlib.Path
    # The step object: model, tokenizer, mesh, shardings, the jitted steps (axcore.trainer.step).
    train_step: TrainStep
    # Progress and log lines (process 0's; the others get a sink).
    stream: TextIO
    # Results (the sample's text).
    out: TextIO
    # The last dispatched step (0 before the first).
    step: int = 0
    # The step the run started from (a resumed run's restored step, else 0).
    start_step: int = 0
    # The train state after `step` (params, opt_state, step, prng_key) on the devices; None before the first.
    state: dict | None = None
    # `step`'s metrics on the device (loss, grad_norm, ...), shape [] each.
    step_metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The record of the current fetch (`train/...`, `eval/...` floats); the last one after it.
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # The totals of the evaluation at this fetch; None when the fetch evaluated nothing.
    eval: EvalTotals | None = None
    # The loss of the last evaluation (nats per token), None before one.
    eval_loss: float | None = None
    # Whether `step` is the run's last (`trainer.max_steps`).
    last: bool = False
    # Whether the run stops after `step` (Ctrl-C): the step is fetched, saved, then the run ends.
    stopping: bool = False
    # Results hooks hand back, by name (SAMPLE: the end-of-run sample's text).
    results: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The run's services, used by the loop's own hooks: the checkpoint backend, the metrics writers,
    # the progress display, the watchdog, the device loader, the data-wait meter.
    checkpoints: Any = None
    writer: MultiWriter | None = None
    progress: ProgressLog | None = None
    watchdog: Watchdog | None = None
    loader: Any = None
    data_wait: Any = None
    # The Ctrl-C guard (`axcore.trainer.interrupt.InterruptGuard`; `.requested`).
    interrupt: Any = None
    # The input pipeline's state after the last batch a step consumed (saved with each checkpoint).
    input_state: Any = None
    # When the first step after the previous fetch began (time.perf_counter()).
    interval_start: float = 0.0

    def say(self, line: str) -> None:
        """One line on the run's stream, below a progress line redrawn on a terminal."""
        isatty = getattr(self.stream, "isatty", None)
        print(("\n" if isatty is not None and isatty() else "") + line, file=self.stream)


# What an `on_run_end` callback gets (the name before the loop was made of hooks).
RunEnd = RunView


class LoopHook:
    """A hook that does nothing: subclass it and override the phases you need (all optional)."""

    # on_step runs at steps divisible by this.
    every: int = 1

    def on_run_start(self, run: RunView) -> None: ...
    def next_batch(self, run: RunView) -> Any:
        return None
    def on_step(self, run: RunView) -> None: ...
    def wants_fetch(self, run: RunView) -> bool:
        return False
    def on_fetch(self, run: RunView) -> None: ...
    def on_eval(self, run: RunView) -> None: ...
    def on_record(self, run: RunView) -> None: ...
    def on_run_end(self, run: RunView) -> None: ...
    def on_run_stopped(self, run: RunView, error: BaseException) -> None: ...


def loop_hooks(registry: Any) -> tuple[list[Any], list[Any]]:
    """`(own, callbacks)`: the hooks the `loop_hooks` registry's factories make, the loop's own ones
    (names in LOOP_HOOKS, in that order) and the others (registration order)."""
    names = list(registry)  # Registration order: built-ins, then plugins in `plugins:` order.
    own = [registry[name]() for name in LOOP_HOOKS if name in names]
    return own, [registry[name]() for name in names if name not in LOOP_HOOKS]


class Hooks:
    """Calls a list of hooks phase by phase (module docstring); a missing method is skipped."""

    def __init__(self, hooks: Sequence[Any]):
        self.hooks = list(hooks)

    def _call(self, phase: str, run: RunView) -> None:
        for hook in self.hooks:
            method = getattr(hook, phase, None)
            if method is not None:
                method(run)

    def step(self, run: RunView) -> bool:
        """`on_step` of the hooks due at `run.step`; whether any hook wants the step's metrics fetched."""
        for hook in self.hooks:
            every = getattr(hook, "every", 1) or 1
            method = getattr(hook, "on_step", None)
            if method is not None and run.step % every == 0:
                method(run)
        return any(hook.wants_fetch(run) for hook in self.hooks if hasattr(hook, "wants_fetch"))

    def fetch(self, run: RunView) -> None:
        """A fetch: `on_fetch`, `on_eval` when it evaluated, `on_record`."""
        run.eval = None
        self._call("on_fetch", run)
        if run.eval is not None:
            self._call("on_eval", run)
        self._call("on_record", run)

    def run_start(self, run: RunView) -> None:
        self._call("on_run_start", run)

    def next_batch(self, run: RunView) -> Any:
        """The step's batch: the first hook's `next_batch(run)` that is not None, else `next(run.loader)`."""
        for hook in self.hooks:
            method = getattr(hook, "next_batch", None)
            loaded = method(run) if method is not None else None
            if loaded is not None:
                return loaded
        return next(run.loader)

    def run_end(self, run: RunView) -> None:
        self._call("on_run_end", run)


def run_stopped(run: RunView, error: BaseException, hooks: Sequence[Any], say: Callable[[str], None]) -> None:
    """Calls `on_run_stopped(run, error)` of each of `hooks` that has one.

    The loop is already failing with `error`: a hook that fails too is reported
    through `say` in one line and the others still run, so `error` stays the one raised.
    """
    for hook in hooks:
        method = getattr(hook, "on_run_stopped", None)
        if method is None:
            continue
        try:
            method(run, error)
        except Exception as e:  # Never hides the error that stopped the run.
            say(f"{type(hook).__name__} after the run stopped failed: {one_line(e) or type(e).__name__}")


__all__ = ["LOOP_HOOKS", "SAMPLE", "Hooks", "LoopHook", "RunEnd", "RunView", "loop_hooks", "run_stopped"]
