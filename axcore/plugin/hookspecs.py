"""Every extension point of axcore, grouped by the phase in which it is called.

Plugins implement any subset of these with `@axcore.hookimpl`; an implementation may
declare fewer arguments than the spec (pluggy passes only those it names), so specs
only ever gain arguments and old plugins keep working.

Calling convention: pluggy calls the hooks, one plugin at a time (through
`PluginManager.subset_hook_caller`): built-in plugins first, then the plugins of the
experiment's `plugins:` list in list order, then an autoloaded hardware plugin, so
every registration knows which plugin and distribution made it and every transform
sees the result of the previous one. The order is axcore's, so implementations may
not ask for another: `tryfirst`, `trylast`, `wrapper` and `hookwrapper` are refused
when the plugin is registered (PluginLoadError). Nothing here stops at the first
non-None result.

Phases:
0. Hookspecs (`axcore_add_hookspecs`): a plugin adds hooks of its own (e.g. a new
   registry family) when it is registered.
1. Registration (`axcore_register_*`): fill typed registries through a `register`
   callback. Each registration spec declares the registry family it fills with
   `@registers(Family(...))` (name, kind of entry, validator, whether configs may
   name entries); `registries.<family>` is built from these declarations. A name
   registered twice is an error naming both distributions unless exactly one
   registration passes `override=True` (that one wins).
2. Settings (`axcore_settings_config`): declare the config of the plugin's own
   top-level section in the experiment file.
3. Config transform (`axcore_transform_config`): a plugin listed in `plugins:`
   edits the experiment's config tree.

Evolution policy (the plugin API, version `PLUGIN_API_VERSION`, MAJOR.MINOR):
- Hookspecs only gain arguments, never lose or rename one, and an argument keeps
  its meaning. A plugin built against an older spec declares fewer arguments and
  keeps working: pluggy passes each implementation only the arguments it names.
  Adding a hook or an argument bumps MINOR.
- A hook or an argument to be retired is first deprecated: its spec gains
  `warn_on_impl=DeprecationWarning(...)` (or `warn_on_impl_args={"arg": ...}`), so
  pluggy warns, naming the plugin's function, when a plugin implementing it is
  registered. It is removed no earlier than the next MAJOR.
- A plugin may require an API version with a module (or class) attribute holding
  a version specifier, e.g. `AXCORE_PLUGIN_API = ">=1.0,<2"`; registering it
  against an axcore whose `PLUGIN_API_VERSION` does not match fails with a one-line
  PluginVersionError naming the plugin. `tests/test_hookspec_policy.py` checks that
  every spec of API 1.0 still exists with its arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from axcore.checkpoint.interop import converter_validator
from axcore.config import Configurable
from axcore.data.tokenizer import Tokenizer
from axcore.experiments import experiment_source_validator
from axcore.kernels.registry import KernelRegistry, OpRegistry, fixed_op_callback
from axcore.layers.pipeline import PipelineSchedule
from axcore.layers.position import PositionEmbedding
from axcore.learning.objectives import Objective
from axcore.learning.optimizers import Optimizer
from axcore.learning.schedules import Schedule
from axcore.markers import PROJECT_NAME, hookimpl, hookspec
from axcore.module import Module
from axcore.observe.factories import MetricsWriterFactory
from axcore.platform.mesh import MeshRule
from axcore.plugin.commands import command_callback, command_validator
from axcore.plugin.register_callbacks import RegisterCommand, RegisterComponent, RegisterKernel, RegisterNamed
from axcore.registry import (
    Family,
    NamedRegistry,
    callable_validator,
    instance_validator,
    module_class_validator,
    registers,
)

if TYPE_CHECKING:
    from axcore.config import ConfigBase
    from axcore.registry import Registries

# The Register* Protocols (axcore/plugin/register_callbacks.py) type each registration hook's `register` argument.
__all__ = ["PLUGIN_API_VERSION", "PROJECT_NAME", "hookimpl", "hookspec"]
__all__ += ["RegisterCommand", "RegisterComponent", "RegisterKernel", "RegisterNamed"]

# Version of the plugin API these specs define (see "Evolution policy" above); a plugin
# requires one with `AXCORE_PLUGIN_API = ">=1.0"`.
PLUGIN_API_VERSION = "1.4"

KERNELS = Family("kernels", "kernel", registry_class=KernelRegistry)


# -- Phase 0: hookspecs ------------------------------------------------------------------


@hookspec
def axcore_add_hookspecs(add_hookspecs: Any) -> None:
    """Add hookspecs of this plugin's own (a new registry family, a hook for other plugins).

    Args:
        add_hookspecs: `add_hookspecs(module_or_class)`; every `axcore_*` function in
            it marked with `@axcore.hookspec` becomes a hook. A registration spec
            decorated with `@axcore.registry.registers(Family(...))` adds registry
            family `registries.<name>`, filled by the plugins implementing it.

    Returns nothing. Called once, right after this plugin is registered with a plugin
    manager, before any registration hook; other plugins may implement the new hooks
    whether they were registered before or after (check_pending runs after all).
    """


# -- Phase 1: registration -------------------------------------------------------------


@registers(Family("layers", "layer", module_class_validator(Module), config_names=True))
@hookspec
def axcore_register_layers(register: RegisterComponent) -> None:
    """Register layer classes that configs can name with `type: <name>`.

    Args:
        register: `register(name, layer_class, *, override=False)`; `layer_class`
            must subclass `axcore.Module`. Names share one namespace with position
            embeddings.

    Returns nothing. Called once per plugin manager, when its registries are first
    needed, for built-ins first and then enabled plugins in `plugins:` order. A
    duplicate name raises DuplicateComponentError naming both distributions unless
    exactly one registration says `override=True`, which then wins.
    """


@registers(
    Family("position_embeddings", "position embedding", module_class_validator(PositionEmbedding), config_names=True)
)
@hookspec
def axcore_register_position_embeddings(register: RegisterComponent) -> None:
    """Register position embedding layers that can fill a position-embedding slot.

    Args:
        register: `register(name, embedding_class, *, override=False)`; the class
            must subclass `axcore.layers.PositionEmbedding`.

    Returns nothing. Called like `axcore_register_layers` (same order, same conflict
    rule); a name may not be both a layer and a position embedding.
    """


@registers(KERNELS, fixed_op_callback("attention"))
@hookspec
def axcore_register_attention_kernels(register: RegisterNamed) -> None:
    """Register implementations of the `attention` op (shorthand for `axcore_register_kernels`).

    Args:
        register: `register(kernel, *, override=False)`; the same as
            `axcore_register_kernels`'s `register("attention", kernel)`. `kernel` has
            `name`, `priority`, `is_supported(AttentionProblem) -> Support` and is
            callable as `kernel(problem, q, k, v, **inputs)` with the layouts of
            `axcore.kernels.attention`.

    Returns nothing. Called like the other registration hooks. At trace time the
    attention layer tries kernels by descending priority (ties by name) and uses the
    first that supports the problem; the op's reference kernel `xla` (priority 0)
    is the fallback. Registration order never decides which kernel runs.
    """


@registers(Family("ops", "op", registry_class=OpRegistry))
@hookspec
def axcore_register_ops(register: RegisterNamed) -> None:
    """Declare ops: named computations that layers call and kernels implement.

    Args:
        register: `register(op, *, override=False)` with an `axcore.kernels.Op`: its
            `name`, its `problem_type` (a subclass of `axcore.kernels.Problem`) and a
            `reference` kernel that supports every problem (registered with it).

    Returns nothing. Called like the other registration hooks, and every plugin's
    ops are registered before any kernel is checked: a kernel registered for an op
    that no plugin declares is an error naming the plugin, and so is a layer
    calling an unknown op. The built-in ops are `dot`, `attention` and `rms_norm`.
    """


@registers(KERNELS)
@hookspec
def axcore_register_kernels(register: RegisterKernel) -> None:
    """Register kernels of declared ops (matmuls, attention, norms, quantized dots, ...).

    Args:
        register: `register(op, kernel, *, override=False)`; `op` is a registered
            `Op` or its name; `kernel` has `name`, `priority`, `is_supported(problem)
            -> Support` and is callable as `kernel(problem, *inputs, **optional)`. It
            may define `state_specs(problem)` for state of its own (see
            `axcore.kernels.Kernel`).

    Returns nothing. Called like the other registration hooks; selection per op is
    by descending priority and `is_supported` (ties by name); a kernel name given
    twice for one op follows the duplicate-name rule.
    """


@registers(Family("mesh_rules", "mesh rule", instance_validator(MeshRule), registry_class=NamedRegistry))
@hookspec
def axcore_register_mesh_rules(register: RegisterNamed) -> None:
    """Register mesh rules mapping instance types to meshes and config modifiers.

    Args:
        register: `register(rule, *, override=False)` with an `axcore.platform.mesh.MeshRule`.

    Returns nothing. Called like the other registration hooks. The first rule whose
    pattern matches the instance type applies, by descending priority; at equal
    priority the experiment's own `mesh_rules:` come first, then registered rules by
    name, and two registered rules of equal priority from different plugins that both
    match are an error naming both (see `axcore.platform.mesh`). Registration order never decides.
    """


@registers(Family("config_modifiers", "config modifier", callable_validator))
@hookspec
def axcore_register_config_modifiers(register: RegisterComponent) -> None:
    """Register config modifiers that an experiment's `mesh_rules:` name with `{type: <name>, ...}`.

    Args:
        register: `register(name, factory, *, override=False)`; `factory(**arguments)`
            takes the entry's other keys (checked against its signature and
            annotations, an unknown one with a "did you mean") and returns a modifier:
            a callable taking the experiment config and returning a new one, never
            editing its input, that raises ConfigError (NoMatchError when its target
            matches nothing) naming itself and its target. An
            `axcore.experiment.config_modifiers.Modifier` is also given the registries.

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule). The matched mesh rule applies its modifiers in order after
    the plugins' config transforms. The built-ins are mesh_shape, remat,
    microbatches, attention_kernel, chunked_loss and compute_dtype (`axcore/experiment/config_modifiers.py`).
    """


@registers(Family("checkpoint_backends", "checkpoint backend", callable_validator))
@hookspec
def axcore_register_checkpoint_backends(register: RegisterComponent) -> None:
    """Register checkpoint backends by name.

    Args:
        register: `register(name, factory, *, override=False)`; `factory(**settings)`
            returns a backend implementing the checkpoint backend protocol.

    Returns nothing. Called like the other registration hooks; duplicate names follow
    the same conflict rule.
    """


@registers(Family("data_sources", "data source", module_class_validator(Configurable), config_names=True))
@hookspec
def axcore_register_data_sources(register: RegisterComponent) -> None:
    """Register input data sources that configs can name with `type: <name>`.

    Args:
        register: `register(name, source_class, *, override=False)`; the class must
            subclass `axcore.data.DataSource`, a Configurable that yields documents
            (`{"tokens": int32 [n], "loss_mask": uint8 [n]}`) of a split: a
            `RandomAccessSource` (`num_documents`, `document(index)`) or a
            `StreamedSource` (`raw_documents`, `to_document`). The input pipeline
            shards, shuffles, packs and batches them (docs/data.md "Sources").

    Returns nothing. Called like the other registration hooks (built-ins first, then
    enabled plugins in `plugins:` order; the same duplicate-name rule). Names share
    the config namespace with layers and position embeddings.
    """


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


@registers(Family("tokenizers", "tokenizer", module_class_validator(Tokenizer), config_names=True))
@hookspec
def axcore_register_tokenizers(register: RegisterComponent) -> None:
    """Register tokenizers that the experiment's `tokenizer:` can name with `type: <name>`.

    Args:
        register: `register(name, tokenizer_class, *, override=False)`; the class must
            subclass `axcore.data.Tokenizer` (a Configurable with `vocab_size`,
            `encode(text)` -> int32 ids and `decode(ids)` -> text).

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule, one config namespace). The built-in is `bytes` (one token
    per UTF-8 byte); the end-of-run sample encodes and decodes with the chosen one.
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
            with any of `on_run_start(run)`, `on_step(run)` (every `hook.every` steps),
            `wants_fetch(run)`, `on_fetch(run)`, `on_eval(run)`, `on_record(run)`,
            `on_run_end(run)`, `on_run_stopped(run, error)`, each given the run's
            public view (`axcore.trainer.hooks.RunView`: step, metrics, step object,
            run directory, config).

    Returns nothing. Called like the other registration hooks (same order, same
    duplicate-name rule). The loop runs its own hooks first (`LOOP_HOOKS`: watchdog,
    fetch, progress, evaluation, metrics_log, checkpoint, interrupt), then the others
    (`Trainer.callbacks`) in registration order: the built-ins `loss_plot` and `sample`,
    then the plugins' hooks in `plugins:` order. Added in plugin API 1.4.
    """


@registers(Family("experiments", "experiment", experiment_source_validator))
@hookspec
def axcore_register_experiments(register: RegisterComponent) -> None:
    """Ship experiments that `axcore train NAME` and `load_experiment(NAME)` find by name.

    Args:
        register: `register(name, source, *, override=False)`; `source` is the
            experiment's YAML text (a str) or its file (a `pathlib.Path` or an
            `importlib.resources` file). The YAML lists the plugins it needs under
            `plugins:` like any experiment file.

    Returns nothing. Called like the other registration hooks. A name is looked up
    among the built-in plugins (which ship axcore/experiments/*.yaml), then plugins
    given as objects, then installed plugins, each loaded on its own (unless
    AXCORE_DISABLE_PLUGIN_AUTOLOAD is set); one name from two plugins is an error
    naming both unless exactly one says override=True, and an unknown name lists
    the available ones.
    """


@registers(Family("commands", "command", command_validator), command_callback)
@hookspec
def axcore_register_commands(register: RegisterCommand) -> None:
    """Add sub-commands to the `axcore` command line (`axcore NAME [ARGS...]`).

    Args:
        register: `register(name, run, *, add_arguments=None, help="", override=False)`;
            `add_arguments(parser)` adds the command's arguments to an argparse parser,
            `run(args)` runs it and returns the exit status (None for 0). Raise an
            `axcore.AxcoreError` for bad input: it is printed as one line, exit 2.

    Returns nothing. Called like the other registration hooks. The CLI looks a
    command up only when the first argument of `axcore` is not a built-in command
    (so `axcore --help` loads no plugin): built-in plugins first, then installed
    plugins, each loaded on its own (unless AXCORE_DISABLE_PLUGIN_AUTOLOAD is set).
    Built-in command names may not be registered; one name from two plugins is an
    error naming both unless exactly one says override=True.
    """


@registers(Family("model_converters", "model converter", converter_validator))
@hookspec
def axcore_register_model_converters(register: RegisterComponent) -> None:
    """Register converters between axcore and an outside checkpoint format, by its model type.

    Args:
        register: `register(model_type, converter, *, override=False)`; `model_type`
            is the outside format's name of the family (Hugging Face `config.json`'s
            `model_type`, e.g. `llama`) and `converter` an `axcore.checkpoint.interop.ModelConverter`
            instance (experiment and outside config both ways, parameters both ways).

    Returns nothing. Called like the other registration hooks. `axcore convert`
    (plugin `hf`) looks a model type up among the built-in plugins, then installed
    plugins, each loaded on its own; one model type from two plugins is an error
    naming both unless exactly one says override=True, and an unknown one lists the
    registered model types.
    """


# -- Before the backend starts: the machine and its compiler flags ------------------------


@hookspec
def axcore_probe_instance_type() -> str | None:
    """Say which instance type this machine is, without starting JAX's backend.

    Returns an instance type like `gpu-h100-8` (platform, device kind, count of this
    host's devices) when the plugin's hardware is present and JAX can use it, else
    None. Called on every installed plugin, before the experiment's plugins load
    and before JAX picks a backend, so XLA flags can still take effect: it may read
    files and the environment (e.g. /proc/driver/nvidia) but must not initialize JAX
    (no `jax.devices()`, no computation). The first non-None answer (plugins by name)
    wins; none means the backend is started to ask JAX.
    """


@hookspec
def axcore_xla_flags(instance_type: str) -> dict[str, str] | None:
    """XLA flags this plugin recommends for an instance type (e.g. `gpu-h100-8`).

    Args:
        instance_type: the run's instance type (`--mesh-selector`, `mesh.instance_type`,
            or the machine's own as probed or detected).

    Returns `{flag: value}` with flag names without the leading `--` (e.g.
    `{"xla_gpu_enable_latency_hiding_scheduler": "true"}`), or None. Called on every
    enabled plugin (built-ins, `plugins:`, the autoloaded hardware plugin); two
    plugins giving one flag different values is an error naming both. The
    experiment's `xla_flags:` entries override these (a null value removes one),
    flags already in the XLA_FLAGS environment variable override both, and
    `axcore config` lists the result. `axcore train` sets them before JAX's backend
    starts.
    """


@hookspec
def axcore_flags_environment(instance_type: str) -> str | None:
    """Name the environment variable that carries compiler flags for an instance type.

    Args:
        instance_type: the run's instance type (e.g. `tpu-v5p-64`).

    Returns the variable's name (`LIBTPU_INIT_ARGS` for TPUs, `NEURON_CC_FLAGS` for
    Trainium), or None for the default, `XLA_FLAGS`. Called on every enabled plugin
    when the experiment's flags are resolved; two plugins naming different variables
    for one instance type is an error naming both. `axcore config` shows a variable
    other than XLA_FLAGS as a `# xla_flags go to NAME` line.
    """


@hookspec
def axcore_runtime_environment(instance_type: str) -> dict[str, str] | None:
    """Environment variables the accelerator runtime reads once, when it starts (API 1.3).

    Args:
        instance_type: the run's instance type (e.g. `gpu-h100-8`).

    Returns `{NAME: value}` (e.g. `{"CUDA_SCALE_LAUNCH_QUEUES": "4x"}`: the CUDA driver's
    launch-queue size), or None. Set where the XLA flags are, before JAX's backend starts
    and only on a machine probed as the instance type's platform; a variable already in
    the environment is never changed, so the user overrides any of them by setting it.
    Called on every enabled plugin whenever an experiment is resolved for a known instance
    type; two plugins giving one variable different values is an error naming both.
    Compiler flags go through `axcore_xla_flags`, not here.
    """


# -- Phase 2: settings -------------------------------------------------------------------


@hookspec
def axcore_settings_config() -> ConfigBase | None:
    """Declare the config of this plugin's own section in the experiment file.

    Returns a fresh `ConfigBase` with defaults, or None if the plugin takes no
    settings. The experiment's top-level key named after the plugin (e.g. `my_feature:`)
    is merged into it with the same validation as any config (unknown keys get a
    "did you mean"). Called once per enabled plugin, in `plugins:` order, before
    config transforms; the result is passed to that plugin's transform as `settings`.
    """


# -- Phase 3: config transforms ----------------------------------------------------------


@hookspec
def axcore_transform_config(config: ConfigBase, settings: ConfigBase | None, registries: Registries) -> ConfigBase:
    """Install a feature by editing the experiment's config tree.

    Args:
        config: the current config tree (already transformed by earlier plugins).
        settings: this plugin's settings (see `axcore_settings_config`), or None.
        registries: the manager's registries, to look up components by name.

    Returns the new config tree; it must not be None. Use `axcore.config.replace`,
    which returns a new tree and raises when nothing matched, so a feature that
    finds nothing to install is an error rather than a silent no-op. Called only for
    enabled plugins, once each, in `plugins:` order; each transform sees the output
    of the previous one, so two plugins touching one slot compose in list order.
    """
