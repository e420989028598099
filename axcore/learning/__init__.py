"""What a training run optimizes and how: objectives (the loss), optimizers and learning-rate schedules.

Registered components (hooks `axcore_register_objectives`, `axcore_register_optimizers`,
`axcore_register_schedules`), below the hook specifications: this package imports only
`axcore.config`, `axcore.module` and `axcore.errors`. The trainer (`axcore.trainer`)
builds its learner and train step from them and re-exports them, so
`from axcore.trainer import Optimizer, Objective` keeps working.
"""

from axcore.learning.objectives import NextToken, Objective, ObjectiveOutput
from axcore.learning.optimizers import SGD, Adafactor, AdamW, Lion, Optimizer, scale_by_adam
from axcore.learning.schedules import Constant, Cosine, DecayShape, LinearDecay, Schedule, WarmupStableDecay

__all__ = [
    "SGD",
    "Adafactor",
    "AdamW",
    "Constant",
    "Cosine",
    "DecayShape",
    "LinearDecay",
    "Lion",
    "NextToken",
    "Objective",
    "ObjectiveOutput",
    "Optimizer",
    "Schedule",
    "WarmupStableDecay",
    "scale_by_adam",
]
