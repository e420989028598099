"""Registration hookspecs of training: optimizers, schedules, pipeline schedules, objectives, metrics writers, loop hooks.

The calling convention, the phases and the evolution policy: `axcore.plugin.hookspecs`.
"""

from __future__ import annotations

from axcore.layers.pipeline import PipelineSchedule
from axcore.learning.objectives import Objective
from axcore.learning.optimizers import Optimizer
from axcore.learning.schedules import Schedule
from axcore.markers import hookspec
from axcore.observe.factories import MetricsWriterFactory
from axcore.plugin.register_callbacks import RegisterComponent
from axcore.registry import Family, callable_validator, module_class_validator, registers

# -- Phase 1: registration: training ---------------------------------------------------


@registers(Family("optimizers", "optimizer", module_class_validator(Optimizer), config_names=True))
@hookspec
def axcore_register_optimizers(register: RegisterComponent) -> None:
    """Register optimizers that `trainer.learner.optimizer` can name with `type: <name>`.

    Args:
        register: `register(name, optimizer_class, *, override=False)`; the class must
            subclass `axcore.trainer.Optimizer` (a Configurable whose `transform()`
            returns an optax GradientTransformation giving the update direction; the
            learner adds clipping, weight decay, the schedule and the freezing of
            non-trainable parameters).

    Returns nothing. Called like the other registration hooks (built-ins first, then
    enabled plugins in `plugins:` order; the same duplicate-name rule). Names share
    the config namespace with layers, data sources and the other config-nameable
    families. The built-ins are adamw, adafactor, lion and sgd.
    """


@registers(Family("schedules", "learning-rate schedule", module_class_validator(Schedule), config_names=True))
@hookspec
def axcore_register_schedules(register: RegisterComponent) -> None:
    """Register learning-rate schedules that `trainer.learner.schedule` can name with `type: <name>`.

    Args:
        register: `register(name, schedule_class, *, override=False)`; the class must
            subclass `axcore.trainer.Schedule` (a Configurable with `warmup_steps`
            whose `after_warmup(peak, num_steps)` returns step -> learning rate).

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule, one config namespace). The built-ins are constant, cosine,
    linear_decay and wsd (warmup-stable-decay).
    """


@registers(
    Family("pipeline_schedules", "pipeline schedule", module_class_validator(PipelineSchedule), config_names=True)
)
@hookspec
def axcore_register_pipeline_schedules(register: RegisterComponent) -> None:
    """Register pipeline schedules that a layer stack's `pipeline` can name with `type: <name>`.

    Args:
        register: `register(name, schedule_class, *, override=False)`; the class must
            subclass `axcore.layers.PipelineSchedule` (a Configurable with `microbatches`
            whose `table(num_stages)` gives `[steps, stages, 2]` (microbatch, repeat) slots,
            -1 = idle, with the dataflow `axcore.layers.pipeline.check_table` checks).

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule, one config namespace). Added in plugin API 1.3. The built-ins
    are gpipe and circular.
    """


@registers(Family("objectives", "objective", module_class_validator(Objective), config_names=True))
@hookspec
def axcore_register_objectives(register: RegisterComponent) -> None:
    """Register training objectives that `trainer.objective` can name with `type: <name>`.

    Args:
        register: `register(name, objective_class, *, override=False)`; the class must
            subclass `axcore.trainer.Objective`, whose `loss(model, params, batch, ...)`
            runs the model (as often as it needs) and returns loss, metrics and output
            collection; contract in `axcore.learning.objectives`.

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule, one config namespace). The built-in is `next_token`.
    """


@registers(
    Family("metrics_writers", "metrics writer", module_class_validator(MetricsWriterFactory), config_names=True)
)
@hookspec
def axcore_register_metrics_writers(register: RegisterComponent) -> None:
    """Register metrics writers that `trainer.metrics_writers` can list as `{type: <name>}`.

    Args:
        register: `register(name, factory_class, *, override=False)`; the class must
            subclass `axcore.observe.MetricsWriterFactory` (a Configurable whose
            `create(run_dir)` returns a writer with `write(step, {name: float})` and
            `close()`).

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule, one config namespace). The built-ins are jsonl and
    tensorboard; the trainer writes every fetched record to each listed writer in
    list order and closes them all at the end of the run.
    """


@registers(Family("loop_hooks", "loop hook", callable_validator))
@hookspec
def axcore_register_loop_hooks(register: RegisterComponent) -> None:
    """Register hooks of the training loop (axcore/trainer/hooks.py): what runs at a cadence.

    Args:
        register: `register(name, factory, *, override=False)`; `factory()` (no
            argument, e.g. the hook's class) makes one hook per `Trainer`: an object
            with any of `on_run_start(run)`, `next_batch(run)` (the step's batch instead of
            the loader's, or None; the first hook to give one wins), `on_step(run)` (every `hook.every` steps),
            `wants_fetch(run)`, `on_fetch(run)`, `on_eval(run)`, `on_record(run)`,
            `on_run_end(run)`, `on_run_stopped(run, error)`, each given the run's
            public view (`axcore.trainer.hooks.RunView`: step, metrics, step object,
            run directory, config).

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule). The loop runs its own hooks first (`LOOP_HOOKS`: watchdog,
    fetch, progress, evaluation, metrics_log, checkpoint, interrupt), then the others
    (`Trainer.callbacks`) in registration order: the built-ins `loss_plot` and `sample`,
    then the plugins' hooks in `plugins:` order. Added in plugin API 1.4 (the
    `next_batch` phase later, the hookspec unchanged: a hook without it works as before).
    """
