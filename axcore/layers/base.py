"""BaseLayer: a Module with a dtype policy, weight initialization and op calls.

Dtype policy (the one place it is defined):

- `param_dtype` is the storage dtype of parameters (the optimizer's master weights);
  `compute_dtype` is the dtype of activations and of both operands of every matmul.
  Both default to None, meaning "the parent layer's", and float32 at the root, so
  `model.compute_dtype: bfloat16` alone gives mixed precision: float32 parameters
  and optimizer state, bfloat16 matmuls and activations. A layer that sets either
  field overrides it for itself and its descendants.
- Parameters are cast to the compute dtype where they are used (inside the `dot`
  op, or by the layer for biases and embeddings), so gradients reach the float32
  master weights in float32.
- Norms, softmax, logits and the loss are computed in float32 whatever the compute
  dtype: norms and attention kernels upcast internally, the output head asks the
  `dot` op for a float32 result, and the loss upcasts the logits.

Op calls: every weight matmul goes through the `dot` op of the kernel registry
(`self._dot(site, x)` for a site declared in `_dot_sites()`), so a kernel plugin
(fp8, int8, a fused GPU matmul) reaches it without a layer change. A kernel's own
state for a site lives among the layer's parameters under `kernel_state/<site>`:
new values computed in the forward pass come back as the kernel's `new_state`;
those declared `overwrite_with_gradient` get theirs as the train step's gradient
(the kernel's custom VJP returns the new value as their cotangent). A kernel may
also store the site's weight in a form of its own (`weight_spec(problem, spec)`
returning another ParameterSpec, e.g. a frozen quantized base under QLoRA): the
weight's parameter is then that spec, the problem still describes the declared
weight, and the kernel receives the stored array as `w`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.config import DType, Floating, InstantiableConfig
from axcore.errors import ConfigError
from axcore.kernels.dot import DOT, DotProblem, dot_problem
from axcore.kernels.registry import Kernel, Op, Problem, current_environment
from axcore.module import Module, no_context
from axcore.params import FanAxes, Initializer, ParameterSpec, ParamInit, constant
from axcore.platform.sharding import activation_spec, constrain

# Key of kernel state (e.g. quantization scales) in a layer's parameter tree.
KERNEL_STATE = "kernel_state"
# Dtype of parameters and computation when no ancestor sets one.
DEFAULT_DTYPE = "float32"


# A remat policy that calls a jax.checkpoint_policies factory: `name(arg, ...)`, string arguments.
_POLICY_CALL = re.compile(r"(\w+)\(([\w\s,]*)\)")


def checkpoint_policy(name: str) -> Any:
    """The `jax.checkpoint` policy a `remat_policy` string names.

    Either an attribute of `jax.checkpoint_policies` (`nothing_saveable`,
    `dots_with_no_batch_dims_saveable`, ...) or a call of one of its factories with
    string arguments, e.g. `offload_dot_with_no_batch_dims(device,pinned_host)` (host
    offloading, memory kinds as arguments) or `save_only_these_names(name1,name2)`.

    Raises:
        AttributeError: no such policy or factory; TypeError: wrong arguments.
    """
    call = _POLICY_CALL.fullmatch(name)
    attribute = name if call is None else call[1]
    found = getattr(jax.checkpoint_policies, attribute, None)
    if not callable(found):
        raise AttributeError(f"jax.checkpoint_policies has no policy or factory '{attribute}'")
    if call is None:
        return found
    return found(*[a.strip() for a in call[2].split(",") if a.strip()])


@dataclasses.dataclass(frozen=True)
class DotSite:
    """A weight matmul of a layer: which weight, and which of its dims are contracted."""

    # Name of the weight among the layer's own parameters.
    weight: str
    # Weight dims contracted with x's trailing dims, in order.
    contract: tuple[int, ...] = (0,)
    # Dtype of the result; None = the compute dtype ("float32" for logits).
    output_dtype: Any = None
    # Dtype both operands are cast to; None = the layer's compute dtype (a router may ask for float32).
    compute_dtype: Any = None
    # Logical axes of x, e.g. ("batch", "seq", "embed"); None = unknown (its partition spec is None).
    x_axes: tuple[str | None, ...] | None = None


class BaseLayer(Module):
    """A module with parameters."""

    class Config(Module.Config):
        """Configures BaseLayer."""

        # Storage dtype of parameters; None = the parent layer's (float32 at the root).
        param_dtype: Annotated[DType, Floating] | None = None
        # Dtype of activations and matmul operands; None = the parent layer's (float32 at the root).
        compute_dtype: Annotated[DType, Floating] | None = None
        # Initialization of this layer's weights (biases and norm scales are constant).
        param_init: ParamInit = ParamInit()
        # Kernel to force per op name, e.g. {dot: xla}; merged over the parent's; None = the parent's.
        kernels: dict[str, str] | None = None
        # Extras for the problems of this layer's ops, {op: {name: value}}; merged over the parent's.
        op_extras: dict[str, Any] | None = None
        # Recompute this layer's forward in the backward pass under this jax.checkpoint_policies policy
        # (e.g. nothing_saveable); None = save every activation.
        remat_policy: str | None = None

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        policy = self._config.remat_policy
        if policy is not None:
            try:
                checkpoint_policy(policy)
            except (AttributeError, TypeError, ValueError) as e:
                raise ConfigError(
                    f"{self.path}: remat_policy '{policy}' is not in jax.checkpoint_policies ({e}); try "
                    f"'nothing_saveable', 'dots_saveable' or a factory call such as "
                    f"'offload_dot_with_no_batch_dims(device,pinned_host)'."
                ) from None

    def _checkpoint_policy(self, method: str) -> Any:
        """The policy of `remat_policy` for `forward`; None where a subclass's Config redeclares the
        field to apply it itself (RepeatedTransformer: per scan step)."""
        config_class = type(self._config)
        below = config_class.__mro__[: config_class.__mro__.index(BaseLayer.Config)]
        itself = any("remat_policy" in vars(c).get("__annotations__", {}) for c in below)
        name = self._config.remat_policy if method == "forward" and not itself else None
        return None if name is None else checkpoint_policy(name)

    # -- Inherited settings -----------------------------------------------------------

    def _inherited(self, field: str) -> list[Any]:
        """Values of `field` from the root down to this layer (unset ones skipped)."""
        values, node = [], self
        while node is not None:
            cfg = node._config  # Read only: `config` would return a deep copy each time.
            if field in cfg.keys() and getattr(cfg, field) is not None:
                values.append(getattr(cfg, field))
            node = node.parent
        return values[::-1]

    @property
    def param_dtype(self) -> np.dtype:
        """Storage dtype of this layer's parameters (policy in the module docstring)."""
        return np.dtype((self._inherited("param_dtype") or [DEFAULT_DTYPE])[-1])

    @property
    def compute_dtype(self) -> np.dtype:
        """Dtype of this layer's activations and matmul operands."""
        return np.dtype((self._inherited("compute_dtype") or [DEFAULT_DTYPE])[-1])

    @no_context
    def kernel_choice(self, op: Op) -> str | None:
        """The kernel name forced for `op` here (nearest `kernels` entry), or None."""
        choice = None
        for kernels in self._inherited("kernels"):
            choice = kernels.get(op.name, choice)
        return choice

    @no_context
    def op_extras(self, op: Op) -> dict[str, Any]:
        """Extras for `op`'s problems here: every ancestor's `op_extras[op]`, nearer ones winning."""
        merged: dict[str, Any] = {}
        for extras in self._inherited("op_extras"):
            merged.update(extras.get(op.name) or {})
        return merged

    # -- Parameters -------------------------------------------------------------------

    def _weight(
        self,
        shape: tuple[int, ...],
        mesh_axes: tuple[str | None, ...],
        fan_axes: FanAxes,
        *,
        weight_decay_scale: float = 1.0,
    ) -> ParameterSpec:
        """Spec of a weight initialized by `param_init` with the given fans."""
        return ParameterSpec(
            shape=tuple(shape),
            dtype=self.param_dtype,
            initializer=self._config.param_init.initializer(fan_axes),
            mesh_axes=mesh_axes,
            weight_decay_scale=weight_decay_scale,
        )

    def _constant(
        self, shape: tuple[int, ...], value: float, mesh_axes: tuple[str | None, ...]
    ) -> ParameterSpec:
        """Spec of a bias or scale: constant init, no weight decay."""
        init: Initializer = constant(value)
        return ParameterSpec(tuple(shape), self.param_dtype, init, mesh_axes, 0.0)

    def parameter_specs(self) -> dict[str, Any]:
        """Own and children's specs, plus the state of the kernels chosen for this layer's dot sites."""
        specs = super().parameter_specs()
        sites = self._dot_sites()
        if not sites:
            return specs
        own = self._create_parameter_specs()
        state = {}
        for site in sites:
            weight = sites[site].weight
            problem = self._dot_problem(site, own[weight])
            kernel = self._select(DOT, problem)
            declared = kernel.state_specs(problem) if hasattr(kernel, "state_specs") else None
            if declared:
                state[site] = dict(declared)
            stored = kernel.weight_spec(problem, own[weight]) if hasattr(kernel, "weight_spec") else None
            if stored is not None:  # The kernel stores the weight in its own form (e.g. quantized, frozen).
                specs[weight] = stored
        if state:
            specs[KERNEL_STATE] = state
        return specs

    # -- Ops --------------------------------------------------------------------------

    def _dot_sites(self) -> dict[str, DotSite]:
        """This layer's weight matmuls by site name. Override in layers that multiply by weights."""
        return {}

    def _dot_problem(self, site: str, weight: Any, x: Any = None) -> DotProblem:
        """The problem of dot site `site` (x None: when declaring parameters, before any input exists)."""
        declared = self._dot_sites()[site]
        w_axes = self._create_parameter_specs()[declared.weight].mesh_axes
        compute = declared.compute_dtype or self.compute_dtype
        env = current_environment()
        return dot_problem(
            jax.ShapeDtypeStruct((), compute),
            weight,
            declared.contract,
            compute_dtype=compute,
            output_dtype=declared.output_dtype,
            w_axes=w_axes,
            site=f"{self.path}.{site}",
            extras=self.op_extras(DOT),
            mesh=env.mesh,
            input_specs=self._input_specs((declared.x_axes, x), (w_axes, weight)) if x is not None else (),
        )

    def _input_specs(self, *inputs: tuple[Any, Any]) -> tuple[Any, ...]:
        """PartitionSpecs of `(logical_axes, array)` inputs under the traced mesh; all None outside one."""
        env = current_environment()
        if env.mesh is None:
            return tuple(None for _ in inputs)
        return tuple(
            None if axes is None else activation_spec(axes, array.shape, env.axis_rules, env.mesh)
            for axes, array in inputs
        )

    def _constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        """x with a sharding constraint from its logical axes (e.g. `("batch", "seq", "embed")`) under the
        traced mesh and axis rules; x unchanged outside a mesh. See `axcore.platform.sharding.constrain`."""
        env = current_environment()
        return constrain(x, axes, env.mesh, env.axis_rules)

    def _select(self, op: Op, problem: Problem) -> Kernel:
        return self.registries.kernels.select(op, problem, requested=self.kernel_choice(op))

    def _dot(self, site: str, x: jax.Array) -> jax.Array:
        """Runs dot site `site` on x through the selected `dot` kernel (with its state, if any)."""
        name = self._dot_sites()[site].weight
        weight = self.parameters[name]
        declared = self._create_parameter_specs()[name]
        # A weight a kernel stores in its own form (`weight_spec`) is described to the problem as declared.
        stored_otherwise = tuple(weight.shape) != tuple(declared.shape) or not jnp.issubdtype(weight.dtype, jnp.inexact)
        problem = self._dot_problem(site, declared.abstract() if stored_otherwise else weight, x)
        kernel = self._select(DOT, problem)
        return self._run_kernel(kernel, site, problem, x, weight)

    def _run_kernel(self, kernel: Kernel, site: str, problem: Problem, *inputs: Any, **optional: Any) -> Any:
        """Calls `kernel`; a kernel with state gets `state=` and returns `(output, new_state)`.

        `new_state` (forward-computed values) becomes a state update. State declared
        `overwrite_with_gradient` is passed through untouched, so the cotangent the
        kernel's VJP gives it reaches the train step, which stores it as the new value.
        """
        if not hasattr(kernel, "state_specs"):
            return kernel(problem, *inputs, **optional)
        state = self.parameters.get(KERNEL_STATE, {}).get(site)
        if state is None:
            raise KeyError(
                f"{self.path}: kernel '{kernel.name}' for site '{site}' keeps state, but the parameters "
                f"hold none; re-create the parameters (initialize) with the same plugins."
            )
        output, new_state = kernel(problem, *inputs, state=state, **optional)
        if new_state is not None:
            self.output_collection.state_updates.setdefault(KERNEL_STATE, {})[site] = new_state
        return output


def with_fields(cfg: InstantiableConfig, **values: Any) -> InstantiableConfig:
    """A copy of `cfg` with those of `values` that it declares set; others are skipped.

    Parents use this to pass dimensions (e.g. `input_dim`) to a slot that may hold
    any component, which declares only the fields it needs.
    """
    fields = set(cfg.keys())
    return cfg.clone(**{k: v for k, v in values.items() if k in fields})
