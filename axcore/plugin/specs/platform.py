"""Hookspecs of the platform: mesh rules, config modifiers, checkpoint backends, and the machine and its flags before the backend starts.

The calling convention, the phases and the evolution policy: `axcore.plugin.hookspecs`.
"""

from __future__ import annotations

from axcore.markers import hookspec
from axcore.platform.mesh import MeshRule
from axcore.plugin.register_callbacks import RegisterComponent, RegisterNamed
from axcore.registry import Family, NamedRegistry, callable_validator, instance_validator, registers

# -- Phase 1: registration: mesh rules, config modifiers and checkpoint backends -------


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


# -- Before the backend starts: the machine and its compiler flags ---------------------


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
