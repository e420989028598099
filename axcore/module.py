"""Modules built from configs, invocation contexts and `functional()`.

A `Module` is a tree node built from its config; children are added in `__init__`
with `self.add_child(name, cfg)` (public; `_add_child` is an alias kept for old
code). Modules hold no arrays: parameters, the PRNG key, the training flag and an
output collection live in an `InvocationContext` that `functional()` opens for the
root. Calling a child's public method from inside its parent's method enters the
child's context: its slice of the parameters, a PRNG key folded from the child's
*name* (so adding a call never changes another child's randomness), the same
training flag, and its own branch of the output collection.

Example:

    model = Linear.default_config().set(input_dim=4, output_dim=2).instantiate(name="proj")
    params = model.initialize(jax.random.key(0))
    y, collection = functional(model, params, inputs=(x,), prng_key=None, is_training=False)
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from axcore.config import ClassConfig, Configurable
from axcore.errors import AxcoreError
from axcore.params import ParameterSpec, fold_in_name, name_to_int

if TYPE_CHECKING:
    from axcore.registry import Registries

# Methods of Module that never enter an invocation context.
_NOT_IN_CONTEXT = frozenset({"parameter_specs", "abstract_parameters", "initialize"})


class InvocationError(AxcoreError):
    """A module method was called outside an invocation context or its parent's context."""


class OutputCollection(NamedTuple):
    """What a call produced besides its return value. Each dict nests by child name.

    summaries: values to log (scalars, histograms), e.g. {"attention": {"entropy": x}}.
    state_updates: new values of non-trainable state.
    module_outputs: auxiliary outputs, e.g. {"router": {"aux_loss": x}}.
    """

    summaries: dict
    state_updates: dict
    module_outputs: dict

    @classmethod
    def empty(cls) -> OutputCollection:
        return cls({}, {}, {})

    def child(self, name: str) -> OutputCollection:
        return OutputCollection(
            *(getattr(self, field).setdefault(name, {}) for field in self._fields)
        )


def _prune(tree: dict) -> dict:
    """Drops empty sub-dicts (children that recorded nothing)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = _prune(value)
            if not value:
                continue
        out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class InvocationContext:
    """The state a module method sees: its parameters, key, mode and outputs."""

    module: Module
    # The module's parameter (and state) tree.
    state: Any
    # PRNG key for this module, or None (e.g. evaluation without randomness).
    prng_key: jax.Array | None
    is_training: bool
    output_collection: OutputCollection

    def child(self, child: Module, state: Any = None) -> InvocationContext:
        """The context of direct child `child`; `state` defaults to its slice of ours."""
        if state is None:
            state = self.state.get(child.name, {}) if isinstance(self.state, dict) else {}
        return InvocationContext(
            module=child,
            state=state,
            prng_key=fold_in_name(self.prng_key, child.name),
            is_training=self.is_training,
            output_collection=self.output_collection.child(child.name),
        )


_CONTEXT: contextvars.ContextVar[InvocationContext | None] = contextvars.ContextVar(
    "axcore_invocation_context", default=None
)


def current_context() -> InvocationContext | None:
    """The innermost active invocation context, or None."""
    return _CONTEXT.get()


class _Enter:
    def __init__(self, ctx: InvocationContext):
        self._ctx = ctx
        self._token = None

    def __enter__(self) -> InvocationContext:
        self._token = _CONTEXT.set(self._ctx)
        return self._ctx

    def __exit__(self, *exc) -> None:
        _CONTEXT.reset(self._token)


def _context_for(module: Module) -> InvocationContext:
    """Derives `module`'s context from the active one (an ancestor's)."""
    ctx = current_context()
    if ctx is None:
        raise InvocationError(
            f"{module.path} was called outside an invocation context; call the root "
            f"module through axcore.functional(...)."
        )
    chain: list[Module] = []
    node: Module | None = module
    while node is not None and node is not ctx.module:
        chain.append(node)
        node = node.parent
    if node is None:
        raise InvocationError(
            f"{module.path} was called from the context of {ctx.module.path}, which is "
            f"not one of its ancestors; only parents may call their children."
        )
    for descendant in reversed(chain):
        ctx = ctx.child(descendant)
    return ctx


def _in_context(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: Module, *args, **kwargs):
        ctx = current_context()
        if ctx is not None and ctx.module is self:
            return method(self, *args, **kwargs)
        return _call(self, method.__name__, functools.partial(method, self), _context_for(self), args, kwargs)

    wrapper.__axcore_in_context__ = True
    return wrapper


def _call(module: Module, name: str, fn: Callable, ctx: InvocationContext, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` in `ctx`; under `jax.checkpoint` if `module._checkpoint_policy(name)` gives a policy."""
    policy = module._checkpoint_policy(name)
    if policy is None:
        with _Enter(ctx):
            return fn(*args, **kwargs)
    # jax.checkpoint needs a pure function: parameters, key and array inputs go in as arguments
    # (other inputs are constants), and the output collection comes back as an output.
    leaves, treedef = jax.tree.flatten((args, kwargs))
    traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

    def pure(state, prng_key, arrays):
        inputs = list(leaves)
        for i, array in zip(traced, arrays):
            inputs[i] = array
        call_args, call_kwargs = jax.tree.unflatten(treedef, inputs)
        collection = OutputCollection.empty()
        with _Enter(dataclasses.replace(ctx, state=state, prng_key=prng_key, output_collection=collection)):
            outputs = fn(*call_args, **call_kwargs)
        return outputs, tuple(_prune(d) for d in collection)

    outputs, collected = jax.checkpoint(pure, policy=policy)(ctx.state, ctx.prng_key, [leaves[i] for i in traced])
    for mine, new in zip(ctx.output_collection, collected):
        deep_merge(mine, new)
    return outputs


def deep_merge(into: dict, update: dict) -> None:
    """Merges `update` into `into` in place: nested dicts merge key by key, any other value replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = value


def no_context(method: Callable) -> Callable:
    """Marks a public Module method as plain (it does not enter an invocation context)."""
    method.__axcore_no_context__ = True
    return method


class Module(Configurable):
    """A node of the module tree. Subclasses add children and declare parameters."""

    class Config(Configurable.Config):
        """Configures Module."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, value in list(cls.__dict__.items()):
            if (
                inspect.isfunction(value)
                and not name.startswith("_")
                and name not in _NOT_IN_CONTEXT
                and not getattr(value, "__axcore_no_context__", False)
                and not getattr(value, "__axcore_in_context__", False)
            ):
                setattr(cls, name, _in_context(value))

    def __init__(
        self,
        cfg: ClassConfig,
        *,
        name: str,
        parent: Module | None = None,
        registries: Registries | None = None,
    ):
        super().__init__(cfg)
        self._name = name
        self._parent = parent
        self._children: dict[str, Module] = {}
        self._registries = registries

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"{type(self).__name__} {self.__dict__.get('_name')!r} has no attribute or child {name!r}.")

    @property
    def name(self) -> str:
        return self._name

    @property
    def parent(self) -> Module | None:
        return self._parent

    @property
    def path(self) -> str:
        """Dotted names from the root, e.g. 'model.decoder.layer0'."""
        return self._name if self._parent is None else f"{self._parent.path}.{self._name}"

    @property
    def children(self) -> dict[str, Module]:
        return dict(self._children)

    @property
    def registries(self) -> Registries:
        """Registries of the plugin manager that built this tree (kernels, layers, ...).

        Raises:
            InvocationError: the root was instantiated without `registries=`; there is
                no fallback, since a built-ins-only registry would silently drop
                every plugin kernel.
        """
        if self._parent is not None:
            return self._parent.registries
        if self._registries is None:
            raise InvocationError(
                f"{self.path} needs the experiment's registries (for kernels), but was instantiated "
                f"without them; build it with cfg.instantiate(name=..., registries=experiment.registries) "
                f"or registries=axcore.create_plugin_manager([...]).registries."
            )
        return self._registries

    @no_context
    def add_child(self, name: str, cfg: ClassConfig, **kwargs) -> Module:
        """Instantiates `cfg` as child `name` and returns it; call it in `__init__`.

        The child is then `self.<name>` and `self.children[name]`; its parameters nest
        under `name` in this module's parameter tree, and its PRNG key is folded from
        `name`, so adding a child changes no other child's parameters or randomness.
        A layer subclass (e.g. a feature plugin's) uses this to add a layer of its own:

            def __init__(self, cfg, **kwargs):
                super().__init__(cfg, **kwargs)
                self.add_child("gate", Linear.default_config().set(input_dim=4, output_dim=4))

        Args:
            name: the child's name, unique among this module's children.
            cfg: an instantiable config of the child.
            kwargs: extra arguments of the child's constructor.

        Raises:
            ValueError: this module already has a child named `name`.
        """
        if name in self._children:
            raise ValueError(f"{self.path} already has a child named {name!r}.")
        child = cfg.instantiate(name=name, parent=self, **kwargs)
        self._children[name] = child
        return child

    def _add_child(self, name: str, cfg: ClassConfig, **kwargs) -> Module:
        """Alias of `add_child` (the name used before it was public)."""
        return self.add_child(name, cfg, **kwargs)

    def __call__(self, *args, **kwargs) -> Any:
        """Same as `forward`."""
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward().")

    def _checkpoint_policy(self, method: str) -> Callable | None:
        """The `jax.checkpoint` policy that calls of `method` run under (rematerialization); None = none."""
        return None

    # -- Parameters ---------------------------------------------------------------

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        """This module's own parameters (not its children's). Override in layers."""
        return {}

    def parameter_specs(self) -> dict[str, Any]:
        """Nested dict of `ParameterSpec` for this module and its descendants."""
        specs: dict[str, Any] = dict(self._create_parameter_specs())
        for name, child in self._children.items():
            child_specs = child.parameter_specs()
            if child_specs:
                specs[name] = child_specs
        return specs

    def abstract_parameters(self) -> dict[str, Any]:
        """The parameter tree as `jax.ShapeDtypeStruct`s; allocates nothing."""
        return jax.tree.map(lambda spec: spec.abstract(), self.parameter_specs())

    def initialize(self, prng_key: jax.Array) -> dict[str, Any]:
        """Materializes `parameter_specs()`.

        Parameter `a/b/w` is drawn with key `fold_in(prng_key, name_to_int("a/b/w"))`,
        so its value depends only on its path, never on which other parameters exist
        or their order. Works eagerly and under `jax.jit` (e.g. with out_shardings).
        Parameters sharing (initializer, shape, dtype) are drawn by one batched draw
        (bit-identical to separate ones), so compile time grows with the number of
        distinct shapes, not of layers.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.parameter_specs())
        values: list[jax.Array | None] = [None] * len(flat)
        groups: dict[tuple, list[tuple[int, int]]] = {}  # (initializer, shape, dtype) -> [(leaf, hash)].
        for i, (path, spec) in enumerate(flat):
            name_hash = name_to_int("/".join(str(entry.key) for entry in path))
            group = (spec.initializer, tuple(spec.shape), jnp.dtype(spec.dtype))
            try:
                hash(group)
            except TypeError:  # An unhashable custom initializer runs as given.
                values[i] = spec.initializer(_fold_in(prng_key, name_hash), spec.shape, spec.dtype)
                continue
            groups.setdefault(group, []).append((i, name_hash))
        for (initializer, shape, dtype), members in groups.items():
            drawn = _draw_batched(prng_key, [name_hash for _, name_hash in members], initializer, shape, dtype)
            for (i, _), value in zip(members, drawn, strict=True):
                values[i] = value
        return jax.tree_util.tree_unflatten(treedef, values)

    # -- Inside an invocation context ----------------------------------------------

    def _context(self) -> InvocationContext:
        ctx = current_context()
        if ctx is None or ctx.module is not self:
            raise InvocationError(f"{self.path} accessed its context outside its own method.")
        return ctx

    @property
    def parameters(self) -> Any:
        """This module's parameter tree in the current call."""
        return self._context().state

    @property
    def prng_key(self) -> jax.Array | None:
        return self._context().prng_key

    @property
    def is_training(self) -> bool:
        return self._context().is_training

    @property
    def output_collection(self) -> OutputCollection:
        return self._context().output_collection

    @no_context
    def add_summary(self, name: str, value: Any) -> None:
        """Records a summary (e.g. a scalar to log) under this module's path."""
        self._context().output_collection.summaries[name] = value

    @no_context
    def add_module_output(self, name: str, value: Any) -> None:
        """Records an auxiliary output (e.g. an auxiliary loss) under this module's path."""
        self._context().output_collection.module_outputs[name] = value

    @no_context
    def add_state_update(self, name: str, value: Any) -> None:
        """Records the new value of non-trainable state `name`."""
        self._context().output_collection.state_updates[name] = value


# Most bytes one batched draw in `Module.initialize` produces at once (it briefly holds
# the stacked draw and its slices, so this bounds the extra memory).
_GROUP_BYTES = 256 * 2**20


def _fold_in(key: jax.Array, name_hash: int) -> jax.Array:
    return jax.random.fold_in(key, jnp.asarray(name_hash, jnp.uint32))


def _draw_batched(key: jax.Array, name_hashes: list[int], initializer, shape: tuple, dtype) -> list[jax.Array]:
    """One draw per name hash, in chunks of at most `_GROUP_BYTES` (see `_draw_group`)."""
    per_chunk = max(1, _GROUP_BYTES // max(1, math.prod(shape) * dtype.itemsize))
    drawn: list[jax.Array] = []
    for start in range(0, len(name_hashes), per_chunk):
        hashes = name_hashes[start : start + per_chunk]
        n = len(hashes)
        if not isinstance(key, jax.core.Tracer):  # Eager: pad to a power of two to reuse compiles.
            hashes = hashes + [0] * ((1 << (n - 1).bit_length()) - n)
        group = _draw_group(key, jnp.asarray(hashes, jnp.uint32), initializer=initializer, shape=shape, dtype=dtype)
        drawn.extend(group[:n])  # Padding draws are dropped.
    return drawn


@functools.partial(jax.jit, static_argnames=("initializer", "shape", "dtype"))
def _draw_group(key, hashes, *, initializer, shape, dtype) -> tuple[jax.Array, ...]:
    """`initializer(fold_in(key, h), shape, dtype)` for every h in `hashes` [n], as n arrays.

    One vmapped draw per (initializer, shape, dtype) instead of one per parameter:
    threefry draws are elementwise in the key, so the values are bit-identical to
    separate draws, while XLA compiles one random-number computation instead of n
    (seconds each on CPU). Eagerly, each (initializer, shape, dtype, n) compiles once
    per process (callers pad n to a power of two); under an outer jit this inlines.
    """
    stacked = jax.vmap(lambda h: initializer(jax.random.fold_in(key, h), shape, dtype))(hashes)
    return tuple(stacked[i] for i in range(hashes.shape[0]))


def functional(
    module: Module,
    state: Any,
    inputs: Any,
    prng_key: jax.Array | None,
    is_training: bool,
    method: str = "forward",
) -> tuple[Any, OutputCollection]:
    """Runs `module.<method>` purely on explicit arguments.

    Args:
        module: the module whose method to run; it need not be a root.
        state: its parameter tree (as from `initialize()`).
        inputs: a dict (keyword arguments), a tuple (positional) or a single argument.
        prng_key: the module's PRNG key, or None.
        is_training: the training flag its descendants see.
        method: name of the method to call.

    Returns:
        `(outputs, output_collection)`; the collection's dicts nest by child name and
        empty branches are dropped. Pure, so it composes with jit, grad, vmap and scan.
    """
    collection = OutputCollection.empty()
    ctx = InvocationContext(module, state, prng_key, is_training, collection)
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    else:
        args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
    outputs = _call(module, method, getattr(module, method), ctx, args, kwargs)
    return outputs, OutputCollection(*(_prune(d) for d in collection))
