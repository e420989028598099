"""Typed configs of the training loop."""

from __future__ import annotations

from axcore.config import ConfigBase
from axcore.trainer.learner import LearnerConfig


class CheckpointConfig(ConfigBase):
    """When and how the train state is saved."""

    # Checkpoint backend by registered name (orbax, tensorstore, or a plugin's).
    backend: str = "orbax"
    # Save every N steps (and always at the end); 0 = only at the end.
    every_n_steps: int = 100
    # Number of committed checkpoints kept; None keeps all.
    keep_last_n: int | None = 3
    # Write in the background while training continues.
    async_save: bool = True
    # Resume from the latest committed checkpoint in the run directory, if there is one.
    resume: bool = True


class SampleConfig(ConfigBase):
    """Text generated from the trained model at the end of the run."""

    # Text the sample continues.
    prompt: str = "The "
    # Number of bytes to generate; 0 disables sampling.
    num_bytes: int = 200
    # Softmax temperature; 0 picks the most likely byte.
    temperature: float = 0.8


class TrainerConfig(ConfigBase):
    """The training loop."""

    # Number of optimizer steps.
    max_steps: int = 300
    # Evaluate on the held-out split every N steps (and at the end); 0 disables.
    eval_every: int = 100
    # Held-out batches per evaluation.
    eval_batches: int = 8
    # Plain progress lines every N steps when the terminal is not a TTY.
    log_every: int = 10
    # Seed of parameter initialization and of per-step randomness (dropout).
    seed: int = 0
    # Run directory; None = runs/<experiment name>-<UTC timestamp>.
    run_dir: str | None = None
    # Optimizer and schedule.
    learner: LearnerConfig = LearnerConfig()
    # Checkpointing.
    checkpoint: CheckpointConfig = CheckpointConfig()
    # Sample printed at the end.
    sample: SampleConfig = SampleConfig()
