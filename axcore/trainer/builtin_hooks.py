"""The loop's own hooks (`axcore.trainer.hooks.LOOP_HOOKS`), registered by axcore/trainer/plugin.py.

In the order they run: `WatchdogBeat` (a beat at each dispatched step), `MetricsFetch`
(keeps the host one step ahead, reads the metrics back every `trainer.log_every` steps
and checks each step's loss and gradient norm since the previous fetch), `Progress`
(the progress display), `Evaluation` (every `trainer.eval_every` steps and at the
last), `MetricsLog` (the record to the metrics writers), `Checkpoint` (every
`trainer.checkpoint.every_n_steps`, at the last step and at a Ctrl-C) and
`InterruptCheck` (a Ctrl-C: the step is fetched and saved, then the run stops).
"""

from __future__ import annotations

import math
import time

import jax

from axcore.data import Split
from axcore.errors import AxcoreError, one_line
from axcore.placement.evaluate import EvalProgress, EvalTotals, describe, eval_metrics, evaluate_input
from axcore.placement.inputs import gather_input_state
from axcore.trainer.hooks import LoopHook, RunView
from axcore.trainer.interrupt import RunInterrupted


class NonFiniteLossError(AxcoreError):
    """The training loss became NaN or infinite."""


def save_step(run: RunView) -> None:
    """Saves `run.state` as step `run.step`, with the input pipeline's position."""
    run.checkpoints.save(run.step, run.state, {"input": gather_input_state(run.input_state), "step": run.step})


class WatchdogBeat(LoopHook):
    """Beats the run's watchdog (`axcore.trainer.watchdog`) as each step is dispatched."""

    def on_step(self, run: RunView) -> None:
        run.watchdog.beat(run.step)


class MetricsFetch(LoopHook):
    """Keeps the host one step ahead of the device and reads metrics back every `trainer.log_every` steps.

    A fetch builds `run.metrics` (`train/<metric>` of the step, `train/step_time` and
    `train/tokens_per_sec` averaged since the previous fetch, data wait and loader
    statistics) and raises NonFiniteLossError at the first step since the previous
    fetch whose loss or gradient norm is not finite.
    """

    def on_run_start(self, run: RunView) -> None:
        # Loss and gradient norm (on the device) of each step since the last fetch.
        self.unchecked: list[tuple[int, tuple[jax.Array, jax.Array]]] = []
        self.fetched_step = run.start_step

    def on_step(self, run: RunView) -> None:
        self.unchecked.append((run.step, (run.step_metrics["loss"], run.step_metrics["grad_norm"])))
        if len(self.unchecked) > 1:  # One step ahead at most (trainer module docstring); step s is queued meanwhile.
            self.unchecked[-2][1][0].block_until_ready()

    def wants_fetch(self, run: RunView) -> bool:
        return run.step % run.config.trainer.log_every == 0 or run.last

    def on_fetch(self, run: RunView) -> None:
        checks, metrics = jax.device_get(([c for _, c in self.unchecked], run.step_metrics))
        steps = run.step - self.fetched_step
        step_time = (time.perf_counter() - run.interval_start) / steps
        self._check_finite(run, [s for s, _ in self.unchecked], [(float(a), float(b)) for a, b in checks])
        self.unchecked, self.fetched_step = [], run.step
        tokens_per_step = run.config.input.batch_size * run.config.input.seq_len
        record = {f"train/{k}": float(v) for k, v in metrics.items()}
        record["train/tokens_per_sec"] = tokens_per_step / step_time
        record["train/step_time"] = step_time
        record.update(run.data_wait.interval(run.loader.take_wait(), steps, step_time, run.step - steps + 1, run.step))
        record.update(run.loader.stats())  # Packing efficiency, tokens per mixture component.
        run.metrics = record

    @staticmethod
    def _check_finite(run: RunView, steps: list[int], checks: list[tuple[float, float]]) -> None:
        """Raises NonFiniteLossError at the first step whose loss or gradient norm is not finite."""
        for step, (loss, grad_norm) in zip(steps, checks):
            if math.isfinite(loss) and math.isfinite(grad_norm):
                continue
            run.checkpoints.wait()
            latest = run.checkpoints.latest_step()
            kept = (
                f"The last good checkpoint is step {latest} in {run.run_dir / 'checkpoints'}"
                if latest is not None
                else "No checkpoint was saved before it"
            )
            raise NonFiniteLossError(
                f"Training diverged at step {step} (loss {loss}, gradient norm {grad_norm}); the run stopped. "
                f"{kept}; lower trainer.learner.learning_rate or check the data."
            )


class Progress(LoopHook):
    """Updates the progress display at each fetch."""

    def on_fetch(self, run: RunView) -> None:
        m = run.metrics
        run.progress.update(run.step, m["train/loss"], m["train/tokens_per_sec"], m["train/step_time"])


class Evaluation(LoopHook):
    """Evaluates every `trainer.eval_every` steps and at the last (`trainer.eval_batches` batches).

    Sets `run.eval` and `run.eval_loss` and adds the `eval/...` metrics to the record;
    its line goes to the run's stream. An evaluation that fails writes the record and
    saves the step first (a failing save is one line), so what was trained is kept.
    """

    def on_run_start(self, run: RunView) -> None:
        self.eval_step = run.train_step.compiled_eval_step()

    def wants_fetch(self, run: RunView) -> bool:
        every = run.config.trainer.eval_every
        return bool(every) and (run.step % every == 0 or run.last)

    def on_fetch(self, run: RunView) -> None:
        if not self.wants_fetch(run):
            return
        try:
            result = self._evaluate(run)
        except Exception:  # This step's training is saved (the run directory kept) before the error stops it.
            run.writer.write(run.step, run.metrics)
            self._save_before_failing(run)
            raise
        run.eval, run.eval_loss = result, result.loss
        run.metrics.update(eval_metrics(result))
        run.watchdog.beat(run.step)

    def _evaluate(self, run: RunView) -> EvalTotals:
        """The evaluation of `run.step`, its line on the run's stream; progress lines for a long one, and
        every batch beats the watchdog."""
        step, budget = run.step, run.config.trainer.eval_batches
        run.watchdog.beat(step, "eval")
        progress = EvalProgress(run.stream, f"eval at step {step}", on_batch=lambda: run.watchdog.beat(step, "eval"))
        params = run.state["params"]
        result = evaluate_input(run.train_step, params, Split.EVAL, budget, eval_step=self.eval_step,
                                progress=progress.for_stream)
        run.say(f"eval at step {step}: {describe(result, f'trainer.eval_batches={budget}')}")
        return result

    @staticmethod
    def _save_before_failing(run: RunView) -> None:
        try:
            save_step(run)
            run.checkpoints.wait()
        except Exception as e:
            print(f"Step {run.step} could not be saved after the failed evaluation: {one_line(e)}", file=run.stream)


class MetricsLog(LoopHook):
    """Writes each fetch's record to the metrics writers (`trainer.metrics_writers`)."""

    def on_record(self, run: RunView) -> None:
        run.writer.write(run.step, run.metrics)


class Checkpoint(LoopHook):
    """Saves every `trainer.checkpoint.every_n_steps` steps, at the last step and at a Ctrl-C."""

    def wants_fetch(self, run: RunView) -> bool:
        every = run.config.trainer.checkpoint.every_n_steps
        return bool(every and run.step % every == 0) or run.last or run.stopping

    def on_record(self, run: RunView) -> None:
        if self.wants_fetch(run):
            run.watchdog.beat(run.step, "checkpoint save")
            save_step(run)
        run.watchdog.beat(run.step)


class InterruptCheck(LoopHook):
    """Reads the Ctrl-C flag (`axcore.trainer.interrupt.InterruptGuard`) at each step; after a stopping
    step's record and save, waits for the save and raises RunInterrupted."""

    def on_step(self, run: RunView) -> None:
        run.stopping = bool(run.interrupt.requested)

    def wants_fetch(self, run: RunView) -> bool:
        return run.stopping

    def on_record(self, run: RunView) -> None:
        if run.stopping:
            run.checkpoints.wait()  # Committed (a second Ctrl-C aborts the wait and the save).
            raise RunInterrupted(step=run.step, saved=True)


# The loop's own hooks by registry name (axcore/trainer/plugin.py registers them; LOOP_HOOKS orders them).
BUILTIN_LOOP_HOOKS = {
    "watchdog": WatchdogBeat,
    "fetch": MetricsFetch,
    "progress": Progress,
    "evaluation": Evaluation,
    "metrics_log": MetricsLog,
    "checkpoint": Checkpoint,
    "interrupt": InterruptCheck,
}

__all__ = ["BUILTIN_LOOP_HOOKS", "Checkpoint", "Evaluation", "InterruptCheck", "MetricsFetch", "MetricsLog",
           "NonFiniteLossError", "Progress", "WatchdogBeat", "save_step"]
