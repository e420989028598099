"""Training: the learner (registered optimizers and schedules on optax), objectives, the train step (which owns
an `axcore.placement.Placement` and adds the optimizer, the objective and the compiled steps) and loop, and the
loop's hooks (`RunView`, `LoopHook`; the end-of-run callbacks: sampling, with the inference engine of
`axcore.engine` just below, and the loss plot)."""

from axcore.learning.objectives import NextToken, Objective, ObjectiveOutput
from axcore.learning.optimizers import SGD, Adafactor, AdamW, Lion, Optimizer, scale_by_adam
from axcore.learning.schedules import Constant, Cosine, DecayShape, LinearDecay, Schedule, WarmupStableDecay
from axcore.trainer.config import CheckpointConfig, SampleConfig, TrainerConfig, WatchdogConfig
from axcore.trainer.hooks import LoopHook, RunView
from axcore.trainer.learner import LearnerConfig, StateUpdateError, build_optimizer, learning_rate_schedule
from axcore.trainer.watchdog import Watchdog

__all__ = [
    "SGD",
    "Adafactor",
    "AdamW",
    "CheckpointConfig",
    "Constant",
    "Cosine",
    "DecayShape",
    "LearnerConfig",
    "Lion",
    "NextToken",
    "Objective",
    "ObjectiveOutput",
    "LinearDecay",
    "LoopHook",
    "Optimizer",
    "RunView",
    "SampleConfig",
    "Schedule",
    "StateUpdateError",
    "TrainerConfig",
    "WarmupStableDecay",
    "Watchdog",
    "WatchdogConfig",
    "build_optimizer",
    "learning_rate_schedule",
    "scale_by_adam",
]
