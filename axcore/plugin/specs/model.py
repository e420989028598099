"""Registration hookspecs of the model: layers, position embeddings, kernels and ops, model converters.

The calling convention, the phases and the evolution policy: `axcore.plugin.hookspecs`.
"""

from __future__ import annotations

from axcore.checkpoint.interop import converter_validator
from axcore.kernels.registry import KernelRegistry, OpRegistry, fixed_op_callback
from axcore.layers.position import PositionEmbedding
from axcore.markers import hookspec
from axcore.module import Module
from axcore.plugin.register_callbacks import RegisterComponent, RegisterKernel, RegisterNamed
from axcore.registry import Family, module_class_validator, registers

KERNELS = Family("kernels", "kernel", registry_class=KernelRegistry)


# -- Phase 1: registration: the model and its kernels ----------------------------------


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
