"""Training: learner (optax), the train loop, evaluation and sampling."""

from axcore.trainer.config import CheckpointConfig, SampleConfig, TrainerConfig
from axcore.trainer.learner import LearnerConfig, Optimizer, Schedule, build_optimizer, learning_rate_schedule

__all__ = [
    "CheckpointConfig",
    "LearnerConfig",
    "Optimizer",
    "SampleConfig",
    "Schedule",
    "TrainerConfig",
    "build_optimizer",
    "learning_rate_schedule",
]
