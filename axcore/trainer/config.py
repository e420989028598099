"""Typed configs of the training loop, and their checks against the registries."""

from __future__ import annotations

import inspect
import os
import typing
from typing import Annotated, Any

from axcore.config import ConfigBase, InstantiableConfig, MaxLength, NonNegative, Positive, Range, Seed, Size
from axcore.config.base import coerce
from axcore.errors import ConfigError, UnknownFieldError, did_you_mean
from axcore.learning.objectives import NextToken, Objective
from axcore.learning.optimizers import Optimizer
from axcore.learning.schedules import Schedule
from axcore.observe.factories import JsonlWriterFactory, MetricsWriterFactory, TensorBoardWriterFactory
from axcore.registry import Registries
from axcore.trainer.learner import LearnerConfig, check_component

# Factory arguments the trainer sets itself (from CheckpointConfig fields of the same names).
_TRAINER_BACKEND_ARGUMENTS = ("keep_last_n", "async_save")


class CheckpointConfig(ConfigBase):
    """When and how the train state is saved."""

    # Checkpoint backend by registered name (orbax, tensorstore, or a plugin's).
    backend: str = "orbax"
    # The backend's own settings, passed to its factory as keyword arguments (e.g. orbax's compress: true).
    backend_settings: dict[str, Any] = {}
    # Save every N steps (and always at the end); 0 = only at the end.
    every_n_steps: Annotated[int, NonNegative] = 100
    # Number of committed checkpoints kept; None keeps all.
    keep_last_n: Annotated[int, Positive] | None = 3
    # Write in the background while training continues.
    async_save: bool = True
    # Resume from the latest committed checkpoint in the run directory, if there is one.
    resume: bool = True
    # Restore exactly this step (fail if it does not verify); None: the latest step that verifies.
    restore_step: Annotated[int, NonNegative] | None = None


class SampleConfig(ConfigBase):
    """Text generated from the trained model at the end of the run (with the experiment's tokenizer)."""

    # Text the sample continues.
    prompt: str = "The "
    # Number of tokens to generate, up to 65536; 0 disables sampling.
    num_tokens: Annotated[int, Size(2**16, "a sample is a glance at the model; axcore generate writes longer text", 0)] = 200
    # Softmax temperature; 0 picks the most likely token.
    temperature: Annotated[float, NonNegative] = 0.8
    # Draw only among the k most likely tokens; None = all.
    top_k: Annotated[int, Positive] | None = None
    # Draw only from the most likely tokens whose probability reaches top_p (nucleus); 1 = all.
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0


class WatchdogConfig(ConfigBase):
    """Hang detection (axcore.trainer.watchdog): all thread stacks logged, then the process exits non-zero.

    Timed from beat to beat, where the loop beats after every step dispatch and around
    evals and checkpoint saves; disarmed until the first step (which compiles) was
    dispatched. Every process of a multi-process job runs its own.
    """

    # Seconds without progress (a loop iteration, eval or save) before all stacks go to <run_dir>/watchdog.log; null: off.
    step_timeout_s: Annotated[float, Range(gt=0, hint="null turns the watchdog off")] | None = 1800.0
    # Seconds after that until the process exits with status 124 (a scheduler restarts it); 0 = only log, never exit.
    exit_timeout_s: Annotated[float, NonNegative] = 300.0


class TrainerConfig(ConfigBase):
    """The training loop."""

    # Number of optimizer steps.
    max_steps: Annotated[int, Positive] = 300
    # Evaluate on the held-out split every N steps (and at the end); 0 disables.
    eval_every: Annotated[int, NonNegative] = 100
    # Held-out batches per evaluation (the eval split's first ones), up to 65536; 0 or null = the whole eval split.
    # A mixture's components are evaluated each alone, these batches split by weight (at least 1 each).
    eval_batches: Annotated[int, Size(2**16, "each evaluation inside training reads at most this many batches; "
                                      "0 or null reads the whole eval split", 0)] | None = 8
    # Read metrics back from the device (record, progress, non-finite check) every N steps (and at eval/checkpoint/last).
    log_every: Annotated[int, Positive] = 10
    # Seed of parameter initialization and of per-step randomness (dropout).
    seed: Annotated[int, Seed] = 0
    # Gradient accumulation: each batch is split into this many microbatches (dividing input.batch_size).
    microbatches: Annotated[int, Positive] = 1
    # Refuse to start when the estimated memory per device exceeds the device's (axcore.trainer.memory_check).
    check_memory: bool = True
    # Run directory; None = runs/<experiment name>-<UTC timestamp>.
    run_dir: Annotated[str, MaxLength(4096)] | None = None
    # The loss the step differentiates: a registered objective (next_token, or a plugin's).
    objective: InstantiableConfig = NextToken.default_config()
    # Optimizer and schedule.
    learner: LearnerConfig = LearnerConfig()
    # Checkpointing.
    checkpoint: CheckpointConfig = CheckpointConfig()
    # Sample printed at the end.
    sample: SampleConfig = SampleConfig()
    # Hang detection: stacks logged, then the process exits (axcore.trainer.watchdog).
    watchdog: WatchdogConfig = WatchdogConfig()
    # Where fetched metrics go: registered metrics writers (jsonl, tensorboard, or a plugin's), in order.
    metrics_writers: list[InstantiableConfig] = [
        JsonlWriterFactory.default_config(),
        TensorBoardWriterFactory.default_config(),
    ]


def check_trainer_config(cfg: TrainerConfig, registries: Registries, path: str = "trainer") -> None:
    """Checks what the registries know: component kinds and the checkpoint backend's settings.

    Raises:
        ConfigError (or a subclass) naming the offending path and what to use instead.
    """
    check_component(cfg.objective, Objective, f"{path}.objective", names=registries.objectives.names())
    learner = f"{path}.learner"
    check_component(cfg.learner.optimizer, Optimizer, f"{learner}.optimizer", names=registries.optimizers.names())
    check_component(cfg.learner.schedule, Schedule, f"{learner}.schedule", names=registries.schedules.names())
    for i, writer in enumerate(cfg.metrics_writers):
        check_component(
            writer,
            MetricsWriterFactory,
            f"{path}.metrics_writers[{i}]",
            kind="metrics writer",
            names=registries.metrics_writers.names(),
        )
    backend_arguments(cfg.checkpoint, registries, f"{path}.checkpoint")


def backend_arguments(cfg: CheckpointConfig, registries: Registries, path: str = "trainer.checkpoint") -> dict[str, Any]:
    """Keyword arguments of the checkpoint backend's factory, checked against its signature.

    `backend_settings` may name any keyword argument of the factory except the
    directory and the ones the trainer sets (`keep_last_n`, `async_save`); values are
    checked against the factory's annotations.

    Raises:
        UnknownComponentError: no backend of that name (the message lists them).
        UnknownFieldError / ConfigTypeError: a setting the factory does not take, or
            of the wrong type, naming `<path>.backend_settings.<key>`.
    """
    factory = registries.checkpoint_backends[cfg.backend]
    parameters = list(inspect.signature(factory).parameters.values())
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    # The first parameter is the checkpoint directory.
    accepted = [p.name for p in parameters[1:] if p.kind in keyword and p.name not in _TRAINER_BACKEND_ARGUMENTS]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    try:
        hints = typing.get_type_hints(factory)
    except (NameError, TypeError):  # Unresolvable annotations in a plugin's factory: values go unchecked.
        hints = {}
    settings = {}
    for key, value in cfg.backend_settings.items():
        where = f"{path}.backend_settings.{key}"
        if key in _TRAINER_BACKEND_ARGUMENTS:
            raise ConfigError(f"'{where}' is set by the trainer; set '{path}.{key}' instead.")
        if key not in accepted and not takes_any:
            raise UnknownFieldError(
                f"Checkpoint backend '{cfg.backend}' takes no setting '{key}' ('{where}'){did_you_mean(key, accepted)}; "
                f"its settings are: {', '.join(accepted) or 'none'}."
            )
        settings[key] = coerce(value, hints[key], where) if key in hints else value
    return settings


def make_checkpoint_backend(cfg: CheckpointConfig, registries: Registries, directory: str | os.PathLike) -> Any:
    """The configured checkpoint backend, writing to `directory`."""
    factory = registries.checkpoint_backends[cfg.backend]
    settings = backend_arguments(cfg, registries)
    return factory(directory, keep_last_n=cfg.keep_last_n, async_save=cfg.async_save, **settings)
