"""Every extension point of axcore, grouped by the phase in which it is called.

Plugins implement any subset of these with `@axcore.hookimpl`; an implementation may
declare fewer arguments than the spec (pluggy passes only those it names), so specs
only ever gain arguments and old plugins keep working.

Calling convention: axcore calls each plugin's implementation on its own, built-in
plugins first and then the plugins of the experiment's `plugins:` list in list
order, so every registration knows which plugin and distribution made it and every
transform sees the result of the previous one. Nothing here stops at the first
non-None result.

Phases:
1. Registration (`axcore_register_*`): fill typed registries through a `register`
   callback. A name registered twice is an error naming both distributions unless
   exactly one registration passes `override=True` (that one wins).
2. Settings (`axcore_settings_config`): declare the config of the plugin's own
   top-level section in the experiment file.
3. Config transform (`axcore_transform_config`): an enabled feature plugin edits
   the experiment's config tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from axcore.config import ConfigBase
    from axcore.kernels.registry import Kernel
    from axcore.mesh import MeshRule
    from axcore.registry import Registries

PROJECT_NAME = "axcore"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterComponent(Protocol):
    def __call__(self, name: str, component: Any, *, override: bool = False) -> None: ...


class RegisterKernel(Protocol):
    def __call__(self, op: str, kernel: Kernel, *, override: bool = False) -> None: ...


class RegisterAttentionKernel(Protocol):
    def __call__(self, kernel: Kernel, *, override: bool = False) -> None: ...


class RegisterMeshRule(Protocol):
    def __call__(self, rule: MeshRule, *, override: bool = False) -> None: ...


# -- Phase 1: registration -------------------------------------------------------------


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


@hookspec
def axcore_register_position_embeddings(register: RegisterComponent) -> None:
    """Register position embedding layers that can fill a position-embedding slot.

    Args:
        register: `register(name, embedding_class, *, override=False)`; the class
            must subclass `axcore.layers.PositionEmbedding`.

    Returns nothing. Called like `axcore_register_layers` (same order, same conflict
    rule); a name may not be both a layer and a position embedding.
    """


@hookspec
def axcore_register_attention_kernels(register: RegisterAttentionKernel) -> None:
    """Register implementations of the attention op.

    Args:
        register: `register(kernel, *, override=False)`; `kernel` has `name`,
            `priority`, `is_supported(AttentionProblem) -> Support` and is callable as
            `kernel(q, k, v, *, causal, bias, kv_mask, scale)` with the layouts of
            `axcore.kernels.attention`.

    Returns nothing. Called like the other registration hooks. At trace time the
    attention layer tries kernels by descending priority (ties by name) and uses the
    first that supports the problem; the built-in `xla` kernel (priority 0) is the
    fallback. Registration order never decides which kernel runs.
    """


@hookspec
def axcore_register_kernels(register: RegisterKernel) -> None:
    """Register kernels for other ops (norms, losses, quantized matmuls, ...).

    Args:
        register: `register(op, kernel, *, override=False)` with `kernel` as in
            `axcore_register_attention_kernels`; `op` names the operation (e.g.
            "rms_norm"), and each op defines its own problem type and call signature.

    Returns nothing. Called like the other registration hooks; selection per op is
    by priority and `is_supported`, as for attention.
    """


@hookspec
def axcore_register_mesh_rules(register: RegisterMeshRule) -> None:
    """Register mesh rules mapping instance types to meshes and config modifiers.

    Args:
        register: `register(rule, *, override=False)` with an `axcore.mesh.MeshRule`.

    Returns nothing. Called like the other registration hooks. The first rule (by
    descending priority, then name) whose pattern matches the instance type applies;
    registration order never decides.
    """


@hookspec
def axcore_register_checkpoint_backends(register: RegisterComponent) -> None:
    """Register checkpoint backends by name.

    Args:
        register: `register(name, factory, *, override=False)`; `factory(**settings)`
            returns a backend implementing the checkpoint backend protocol.

    Returns nothing. Called like the other registration hooks; duplicate names follow
    the same conflict rule.
    """


@hookspec
def axcore_register_data_sources(register: RegisterComponent) -> None:
    """Register input data sources that configs can name with `type: <name>`.

    Args:
        register: `register(name, source_class, *, override=False)`; the class must
            subclass `axcore.data.DataSource` (a Configurable whose `tokens(split)`
            returns a 1-D token array).

    Returns nothing. Called like the other registration hooks (built-ins first, then
    enabled plugins in `plugins:` order; the same duplicate-name rule). Names share
    the config namespace with layers and position embeddings.
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
