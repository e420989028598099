"""Built-in plugin: the optimizers (adamw, adafactor, lion, sgd), learning-rate schedules, objectives (next_token)
and the training loop's hooks (its own, then the loss plot and the end-of-run sample)."""

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


@hookimpl
def axcore_register_loop_hooks(register):
    from axcore.trainer.builtin_hooks import BUILTIN_LOOP_HOOKS  # The loop's modules load when a loop is built.
    from axcore.trainer.callbacks import BUILTIN_CALLBACKS

    for name, hook in {**BUILTIN_LOOP_HOOKS, **BUILTIN_CALLBACKS}.items():
        register(name, hook)
