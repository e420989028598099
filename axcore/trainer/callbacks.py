"""Callbacks of the training loop: what runs after the last step (the loss plot, the end-of-run sample).

A callback is any object with `on_run_end(run: RunEnd) -> None`. The loop
(`axcore.trainer.trainer.Trainer`) calls each of `trainer.callbacks`, in order, once
training finished without error (the checkpoints are written, the metrics writers
closed), on every process; a callback that writes files checks `is_primary()` itself.
`Trainer(experiment, callbacks=[...])` replaces the defaults, `trainer.callbacks.append(cb)`
adds one (Levanter's `trainer.add_hook`):

    class Report:
        def on_run_end(self, run):
            print("final loss", run.trainer.run_dir, run.state["step"])

    trainer = Trainer(experiment)
    trainer.callbacks.append(Report())

The defaults, `default_callbacks()`: `LossPlot` (`<run_dir>/loss.png` from the run's
`metrics.jsonl`, process 0) and `Sample` (text generated from the trained model with
`trainer.sample`, printed to the loop's `out`; its text is `TrainResult.sample`).
A callback hands a result back through `run.results[name]`; `"sample"` is the one the
loop returns.

A callback may also have `on_run_stopped(run: RunEnd, error: BaseException) -> None`,
called (through `run_stopped`) instead when the loop ends early: Ctrl-C (`error` a
`KeyboardInterrupt`) or a failure in the loop, after the metrics writers are closed and
before the run directory is marked. `run.state` is then the state of the last
dispatched step, or None before there was one; it may be unusable (donated). `LossPlot`
writes the plot of the steps logged so far; the sample is not drawn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from axcore.errors import one_line
from axcore.generation import Generator, Sampling
from axcore.observe import MetricsError, plot_loss_curve
from axcore.observe.factories import JsonlWriterFactory
from axcore.platform.distributed import is_primary

# `RunEnd.results` key of the end-of-run sample's text (the loop's `TrainResult.sample`).
SAMPLE = "sample"


@dataclasses.dataclass
class RunEnd:
    """What an `on_run_end` callback gets."""

    # The loop (its cfg, run_dir, model, tokenizer, stream, out, step object).
    trainer: Any
    # The final train state (params, opt_state, step, prng_key), on the devices.
    state: dict
    # Results callbacks hand back, by name ("sample": the end-of-run sample's text).
    results: dict[str, Any] = dataclasses.field(default_factory=dict)


class Callback(Protocol):
    """Anything with `on_run_end`; called once after a run's last step (module docstring)."""

    def on_run_end(self, run: RunEnd) -> None: ...


class LossPlot:
    """Writes `<run_dir>/loss.png` from the run's `metrics.jsonl` (process 0; nothing without the file),
    at the end of a run and when it stops early (the steps logged so far; nothing if none was)."""

    def on_run_end(self, run: RunEnd) -> None:
        trainer = run.trainer
        metrics_file = trainer.run_dir / JsonlWriterFactory.FILENAME
        if metrics_file.exists() and is_primary():
            plot_loss_curve(
                metrics_file, trainer.run_dir / "loss.png", run_name=trainer.run_dir.name, experiment=trainer.cfg.name,
                token_unit=trainer.tokenizer.token_unit,
            )

    def on_run_stopped(self, run: RunEnd, error: BaseException) -> None:
        try:
            self.on_run_end(run)
        except MetricsError:  # Stopped before the first logged step: no curve to draw.
            pass


class Sample:
    """The end-of-run sample (`trainer.sample`): `run.results["sample"]` = `Trainer._sample(params)`."""

    def on_run_end(self, run: RunEnd) -> None:
        tokens = run.trainer.cfg.trainer.sample.num_tokens
        if tokens > 0:  # Generation compiles and runs token by token: seconds.
            print(f"Sampling {tokens} tokens from the trained model...", file=run.trainer.stream)
        run.results[SAMPLE] = run.trainer._sample(run.state["params"])


def run_stopped(run: RunEnd, error: BaseException, callbacks: Sequence[Any], say: Callable[[str], None]) -> None:
    """Calls `on_run_stopped(run, error)` of each of `callbacks` that has one (module docstring).

    The loop is already failing with `error`: a callback that fails too is reported
    through `say` in one line and the others still run, so `error` stays the one raised.
    """
    for callback in callbacks:
        hook = getattr(callback, "on_run_stopped", None)
        if hook is None:
            continue
        try:
            hook(run, error)
        except Exception as e:  # Never hides the error that stopped the run.
            say(f"{type(callback).__name__} after the run stopped failed: {one_line(e) or type(e).__name__}")


def default_callbacks() -> list[Callback]:
    """The loop's callbacks unless told otherwise: the loss plot, then the sample."""
    return [LossPlot(), Sample()]


def sample_text(step: Any, params: Any, scfg: Any, out: Any, seed: int) -> str:
    """Text generated from `params` with the settings `scfg` (a `SampleConfig`), printed to `out`.

    `step` is the `TrainStep` (its model, tokenizer and op environment). The prompt and
    the number of tokens are cut to the model's learned positions (one line on `out`
    says so). Returns the prompt plus the generated text; "" when `scfg.num_tokens` is 0
    or the prompt encodes to nothing.
    """
    if scfg.num_tokens <= 0:
        return ""
    tokenizer = step.tokenizer
    eos = getattr(tokenizer, "eos_id", None)
    prompt, num_tokens = np.asarray(tokenizer.encode(scfg.prompt)), scfg.num_tokens
    limit = step.model.max_cache_len()  # Learned input positions end at their max_len.
    if limit is not None and len(prompt) + num_tokens > limit:
        prompt = prompt[-(limit - 1):] if len(prompt) >= limit else prompt
        num_tokens = limit - len(prompt)
        print(
            f"Sample: {num_tokens} of trainer.sample.num_tokens={scfg.num_tokens} tokens, as the model's "
            f"learned positions end at {limit}.",
            file=out,
        )
    if len(prompt) == 0:
        return ""
    generator = Generator(
        step.model,
        max_new_tokens=num_tokens,
        sampling=Sampling(scfg.temperature, scfg.top_k, scfg.top_p),
        stop_tokens=() if eos is None else (eos,),
    )
    with step.op_environment():
        [tokens] = generator(params, [prompt], jax.random.key(seed))
    text = scfg.prompt + tokenizer.decode(np.asarray(tokens))
    print(f"Sample:\n{text}", file=out)
    return text


__all__ = ["SAMPLE", "Callback", "LossPlot", "RunEnd", "Sample", "default_callbacks", "run_stopped", "sample_text"]
