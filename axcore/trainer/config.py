"""Typed configs of the training loop, and their checks against the registries."""

from __future__ import annotations

from typing import Annotated

from axcore.config import ConfigBase, InstantiableConfig, MaxLength, NonNegative, Positive, Range, Seed, Size
from axcore.learning.objectives import NextToken, Objective
from axcore.learning.optimizers import Optimizer
from axcore.learning.schedules import Schedule
from axcore.observe.factories import JsonlWriterFactory, MetricsWriterFactory, TensorBoardWriterFactory
from axcore.placement.backend import CheckpointConfig, backend_arguments
from axcore.registry import Registries
from axcore.trainer.learner import LearnerConfig, check_component


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
