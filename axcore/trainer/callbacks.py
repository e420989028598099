"""Callbacks of the training loop: hooks that run after the last step (the loss plot, the end-of-run sample).

A callback is a loop hook (`axcore.trainer.hooks`) that is not one of the loop's own:
any object with some of `on_step(run)` (every `every` steps), `on_fetch(run)`,
`on_eval(run)`, `on_record(run)`, `on_run_end(run)`, `on_run_stopped(run, error)`, each
given the run's public view (`axcore.trainer.hooks.RunView`: the step number, the
fetched metrics, the step object, the run directory, the config). `on_run_end` runs
once training finished without error (the checkpoints are written, the metrics writers
closed), on every process; a callback that writes files checks `is_primary()` itself.

A plugin adds one with `axcore_register_loop_hooks` (`register(name, factory)`, the
factory called with no argument for each `Trainer`); the built-in plugin registers the
defaults the same way, `loss_plot` (`LossPlot`) and `sample` (`Sample`). A Trainer's
`callbacks` are the registered ones in registration order; `Trainer(experiment,
callbacks=[...])` replaces them and `trainer.callbacks.append(cb)` adds one (Levanter's
`trainer.add_hook`):

    class Report:
        def on_run_end(self, run):
            print("final loss", run.run_dir, run.state["step"])

    trainer = Trainer(experiment)
    trainer.callbacks.append(Report())

`LossPlot` writes `<run_dir>/loss.png` from the run's `metrics.jsonl` (process 0) and
`Sample` the text generated from the trained model with `trainer.sample`, printed to
the loop's `out`; its text is `TrainResult.sample`. A callback hands a result back
through `run.results[name]`; `"sample"` is the one the loop returns.

`on_run_stopped(run, error)` is called (through `run_stopped`) instead of `on_run_end`
when the loop ends early: Ctrl-C (`error` a `KeyboardInterrupt`) or a failure in the
loop, after the metrics writers are closed and before the run directory is marked.
`run.state` is then the state of the last dispatched step, or None before there was
one; it may be unusable (donated). `LossPlot` writes the plot of the steps logged so
far; the sample is not drawn.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from axcore.engine.engine import Engine
from axcore.engine.offline import offline_config, run_requests
from axcore.engine.requests import GenerationRequest, SamplingParams
from axcore.observe import MetricsError, plot_loss_curve
from axcore.observe.factories import JsonlWriterFactory
from axcore.platform.distributed import is_primary
from axcore.trainer.hooks import SAMPLE, RunEnd, RunView, run_stopped


class Callback(Protocol):
    """Anything with `on_run_end` (and optionally the other hook phases, module docstring)."""

    def on_run_end(self, run: RunView) -> None: ...


class LossPlot:
    """Writes `<run_dir>/loss.png` from the run's `metrics.jsonl` (process 0; nothing without the file),
    at the end of a run and when it stops early (the steps logged so far; nothing if none was)."""

    def on_run_end(self, run: RunView) -> None:
        metrics_file = run.run_dir / JsonlWriterFactory.FILENAME
        if metrics_file.exists() and is_primary():
            plot_loss_curve(
                metrics_file, run.run_dir / "loss.png", run_name=run.run_dir.name, experiment=run.config.name,
                token_unit=run.train_step.tokenizer.token_unit,
            )

    def on_run_stopped(self, run: RunView, error: BaseException) -> None:
        try:
            self.on_run_end(run)
        except MetricsError:  # Stopped before the first logged step: no curve to draw.
            pass


class Sample:
    """The end-of-run sample (`trainer.sample`): `run.results["sample"]` = `sample_text` of the final params."""

    def on_run_end(self, run: RunView) -> None:
        scfg = run.config.trainer.sample
        if scfg.num_tokens > 0:  # Generation compiles and runs token by token: seconds.
            print(f"Sampling {scfg.num_tokens} tokens from the trained model...", file=run.stream)
        run.results[SAMPLE] = sample_text(run.train_step, run.state["params"], scfg, run.out, run.config.trainer.seed)


def default_callbacks() -> list[Callback]:
    """The built-in callbacks (registered as `loss_plot` and `sample`): the loss plot, then the sample."""
    return [LossPlot(), Sample()]


# The built-in callbacks by registry name (axcore/trainer/plugin.py registers them, in this order).
BUILTIN_CALLBACKS = {"loss_plot": LossPlot, "sample": Sample}


def sample_text(step: Any, params: Any, scfg: Any, out: Any, seed: int) -> str:
    """Text generated from `params` with the settings `scfg` (a `SampleConfig`), printed to `out`.

    `step` is the `TrainStep` (its model, tokenizer and op environment). The text comes
    from the inference engine (`axcore.engine.offline`, on `params` without a copy, under
    the step's op environment), its draws seeded by `seed`; the tokenizer's end-of-sequence
    token ends it. The prompt and the number of tokens are cut to the model's learned
    positions (one line on `out` says so). Returns the prompt plus the generated text; "" when `scfg.num_tokens` is 0
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
    sampling = SamplingParams(max_tokens=num_tokens, temperature=scfg.temperature, top_k=scfg.top_k or 0,
                              top_p=scfg.top_p, seed=seed)
    config = offline_config(step.model, [len(prompt)], num_tokens, seed=seed)
    with step.op_environment():
        engine = Engine(step.model, params, config=config, eos_token_ids=() if eos is None else (eos,))
        [output] = run_requests(engine, [GenerationRequest("sample", prompt.tolist(), sampling)])
    tokens = output.choices[0].token_ids
    text = scfg.prompt + tokenizer.decode(np.asarray(tokens))
    print(f"Sample:\n{text}", file=out)
    return text


__all__ = ["BUILTIN_CALLBACKS", "SAMPLE", "Callback", "LossPlot", "RunEnd", "Sample", "default_callbacks", "run_stopped",
           "sample_text"]
