"""Built-in plugin of learning: the optimizers (adamw, adafactor, lion, sgd), learning-rate schedules and objectives (next_token)."""

from axcore.learning.objectives import OBJECTIVES
from axcore.learning.optimizers import OPTIMIZERS
from axcore.learning.schedules import SCHEDULES
from axcore.markers import hookimpl


@hookimpl
def axcore_register_optimizers(register):
    for name, optimizer in OPTIMIZERS.items():
        register(name, optimizer)


@hookimpl
def axcore_register_schedules(register):
    for name, schedule in SCHEDULES.items():
        register(name, schedule)


@hookimpl
def axcore_register_objectives(register):
    for name, objective in OBJECTIVES.items():
        register(name, objective)
