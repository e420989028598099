"""Ops and their kernels: declared ops, problems, selection by priority and `is_supported`.

An *op* (`dot`, `attention`, ...) is a declared object: a name, the type of the
problem that describes one call, and a reference kernel that supports every
problem (the fallback). Ops are registered through `axcore_register_ops`; kernels
through `axcore_register_kernels` name a registered op, and a kernel for an unknown
op, or a call of an unknown op, is an error.

`KernelRegistry.select(op, problem)` tries the op's kernels in descending priority
(ties broken by name, so registration and install order never decide), logs why each
declining kernel declined (once per op, kernel and reason), and returns the first
that supports the problem.

Every problem carries `platform`, the `mesh` of the computation being traced (None
outside a mesh), the `input_specs` (one PartitionSpec or None per array input, from
the logical axes of the call site and the run's axis rules) and an open `extras`
map, so a new capability needs no core edit: a plugin sets an extras entry on a
layer's config and registers a kernel that understands it; kernels (the reference
ones included) decline extras they do not know.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from axcore.errors import KernelNotSupportedError, UnknownComponentError, did_you_mean
from axcore.registry import NamedRegistry, Provenance, Registries, Registry

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Support:
    """A kernel's answer to `is_supported`: ok, or the reason it declines."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


@runtime_checkable
class Kernel(Protocol):
    """One implementation of an op.

    `name` identifies it (configs may force it by name); higher `priority` is tried
    first; `is_supported(problem)` returns a `Support`; `kernel(problem, *inputs,
    **optional_inputs)` computes the op (each op documents its inputs).

    A kernel may also define `state_specs(problem) -> {name: ParameterSpec}`: state it
    keeps per call site (e.g. quantization scales). The layer declares those specs
    among its parameters (under `kernel_state/<site>`), calls the kernel with
    `state=` that tree (gradient stopped), and the kernel returns `(output,
    new_state)`; `new_state` (or None) becomes the site's state after the step.
    State known only in the backward pass (e.g. an fp8 gradient's amax history) is
    declared with `ParameterSpec(trainable=False, overwrite_with_gradient=True)`: it is
    not gradient-stopped, the kernel's custom VJP returns its new value as its
    cotangent, and the train step stores that gradient as its value (zero if the site
    is unused in the step, the sum if it is used more than once).

    A `dot` kernel may also define `weight_spec(problem, spec) -> ParameterSpec | None`:
    the form it stores the site's weight in (e.g. a frozen quantized base, uint8,
    `trainable=False`), declared by the layer in place of the weight's own `spec`; the
    problem still describes the declared weight and the kernel gets the stored array
    as `w`. The train step differentiates with `allow_int`, so an integer frozen leaf
    gets a zero gradient of its own dtype.
    """

    name: str
    priority: int

    def is_supported(self, problem: Any) -> Support: ...

    def __call__(self, problem: Any, *args, **kwargs) -> Any: ...


@dataclasses.dataclass(frozen=True)
class OpEnvironment:
    """What kernels may know about the computation being traced."""

    # The device mesh, or None (a single device, or outside a run).
    mesh: Any = None
    # Logical axis -> mesh axis (or axes, or None).
    axis_rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Platform the computation is for ("gpu", "tpu", ...); None = JAX's default backend. Set when
    # resolving for another machine (`--mesh-selector`), so kernels answer for that target.
    platform: str | None = None
    # The run's instance type (e.g. gpu-h100-8), or None; kernels may read a device kind from it.
    instance_type: str | None = None
    # Resolving for another machine: kernels are selected (and recorded) for the target, but the
    # op's reference kernel computes, since the target's kernels may not run here.
    stand_in: bool = False


_ENVIRONMENT: contextvars.ContextVar[OpEnvironment] = contextvars.ContextVar(
    "axcore_op_environment", default=OpEnvironment()
)


# op name -> kernel name -> call sites, while `record_kernel_choices` is active.
_CHOICES: contextvars.ContextVar[dict[str, dict[str, list[str]]] | None] = contextvars.ContextVar(
    "axcore_kernel_choices", default=None
)


@contextlib.contextmanager
def record_kernel_choices() -> Iterator[dict[str, dict[str, list[str]]]]:
    """Records, while active, which kernel `KernelRegistry.select` picks for each op and call site.

    Yields `{op: {kernel: [site, ...]}}`, filled as ops are traced (e.g. while a train
    step is jitted or `jax.eval_shape`d inside the block).
    """
    choices: dict[str, dict[str, list[str]]] = {}
    token = _CHOICES.set(choices)
    try:
        yield choices
    finally:
        _CHOICES.reset(token)


@dataclasses.dataclass(frozen=True)
class KernelDecision:
    """Which kernel one op call (site) got, and why the kernels tried before it declined."""

    # Op name, e.g. "attention".
    op: str
    # Dotted path of the call site (the problem's `site`), "?" if it has none.
    site: str
    # The kernel selected.
    kernel: str
    # (kernel, reason) of each higher-priority kernel that declined, in the order tried.
    declined: tuple[tuple[str, str], ...] = ()
    # True when a layer's `kernels: {op: name}` forced this kernel (nothing else was tried).
    forced: bool = False


_DECISIONS: contextvars.ContextVar[list[KernelDecision] | None] = contextvars.ContextVar(
    "axcore_kernel_decisions", default=None
)


@contextlib.contextmanager
def record_kernel_decisions() -> Iterator[list[KernelDecision]]:
    """Records, while active, one `KernelDecision` per kernel selection, in call order."""
    decisions: list[KernelDecision] = []
    token = _DECISIONS.set(decisions)
    try:
        yield decisions
    finally:
        _DECISIONS.reset(token)


def format_kernel_decisions(decisions: Sequence[KernelDecision]) -> str:
    """One block per distinct (op, kernel, declines): the sites, then why each earlier kernel declined.

        attention -> cudnn  (16 sites: model.decoder.layer0.self_attention.attention, ...)
          declined first: (none)
    """
    groups: dict[tuple[str, str, tuple[tuple[str, str], ...], bool], list[str]] = {}
    for d in decisions:
        groups.setdefault((d.op, d.kernel, d.declined, d.forced), []).append(d.site)
    lines = []
    for (op, kernel, declined, forced), sites in sorted(groups.items(), key=lambda item: (item[0][0], item[1][0])):
        how = "forced by the layer's kernels setting" if forced else f"{len(sites)} site{'s' * (len(sites) != 1)}"
        lines.append(f"{op} -> {kernel}  ({how})")
        lines.extend(f"  site {site}" for site in sites)
        lines.extend(f"  declined {name}: {reason}" for name, reason in declined)
    return "\n".join(lines) + "\n" if lines else ""


def describe_kernel_choices(choices: Mapping[str, Mapping[str, Sequence[str]]]) -> dict[str, str]:
    """`{op: "kernel (n sites), ..."}` for `record_kernel_choices` results, kernels by descending use.

    n counts distinct call sites (`Problem.site`), however often a site was traced: the
    same model gives the same words whether one forward pass was traced (`axcore config`)
    or a whole train step, whose backward pass and any retrace select again (`axcore train`).
    """
    out = {}
    for op, kernels in sorted(choices.items()):
        distinct = {name: len(set(sites)) for name, sites in kernels.items()}
        ranked = sorted(distinct.items(), key=lambda item: (-item[1], item[0]))
        out[op] = ", ".join(f"{name} ({n} site{'s' if n != 1 else ''})" for name, n in ranked)
    return out


def current_environment() -> OpEnvironment:
    """The innermost `op_environment`, or an empty one."""
    return _ENVIRONMENT.get()


@contextlib.contextmanager
def op_environment(
    mesh: Any,
    axis_rules: Mapping[str, Any] | None = None,
    *,
    platform: str | None = None,
    instance_type: str | None = None,
    stand_in: bool | None = None,
) -> Iterator[OpEnvironment]:
    """Makes `mesh`, `axis_rules` (and a target platform / instance type) visible to the problems
    of ops traced inside; `platform`, `instance_type` and `stand_in` left None inherit the enclosing ones."""
    outer = _ENVIRONMENT.get()
    env = OpEnvironment(
        mesh,
        dict(axis_rules or {}),
        platform or outer.platform,
        instance_type or outer.instance_type,
        outer.stand_in if stand_in is None else stand_in,
    )
    token = _ENVIRONMENT.set(env)
    try:
        yield env
    finally:
        _ENVIRONMENT.reset(token)


# op name -> the kernel `select` tries first when a call names none (`preferred_kernels`).
_PREFERRED: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "axcore_preferred_kernels", default=None
)


@contextlib.contextmanager
def preferred_kernels(choices: Mapping[str, str] | None) -> Iterator[None]:
    """While active, `KernelRegistry.select` tries `choices[op]` (op name -> kernel name) first for calls
    that name no kernel (a layer's own `kernels` choice still wins); if it declines a problem, selection
    falls back to priority order. An unknown kernel name raises when an op of that name is selected.
    (The inference engine traces its programs inside its `EngineConfig.kernels`.)"""
    token = _PREFERRED.set(dict(choices or {}))
    try:
        yield
    finally:
        _PREFERRED.reset(token)


# True while the programs being traced are never differentiated (`forward_only_programs`).
_FORWARD_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("axcore_forward_only", default=False)


@contextlib.contextmanager
def forward_only_programs() -> Iterator[None]:
    """While active, the programs traced inside are never differentiated (the inference engine's), so kernels
    without a backward pass may serve them: they check `tracing_forward_only()` in `is_supported`."""
    token = _FORWARD_ONLY.set(True)
    try:
        yield
    finally:
        _FORWARD_ONLY.reset(token)


def tracing_forward_only() -> bool:
    """Whether the innermost trace is inside `forward_only_programs` (no gradient will be taken)."""
    return _FORWARD_ONLY.get()


def current_platform() -> str:
    """The platform problems are built for: the `op_environment`'s, else JAX's default backend."""
    import jax  # Only when a problem is built (a backend is up or being targeted).

    platform = current_environment().platform or jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """Fields every op's problem has; each op's problem type subclasses it."""

    # jax.default_backend() of the computation: "cpu", "gpu", "tpu", ...
    platform: str
    # The mesh of the computation (jax.sharding.Mesh or AbstractMesh), or None.
    mesh: Any = None
    # One PartitionSpec (or None: unknown) per array input, in call order.
    input_specs: tuple[Any, ...] = ()
    # Open capabilities: name -> static value; kernels decline names they do not know.
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def unknown_extras(problem: Problem, known: Sequence[str] = ()) -> Support:
    """SUPPORTED if `problem.extras` holds only names in `known`, else a decline naming the rest."""
    unknown = sorted(set(problem.extras) - set(known))
    if unknown:
        return Support(False, f"does not implement extras {unknown}")
    return SUPPORTED


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """A declared op: its name, the type of its problems and its reference kernel."""

    # Registered name, e.g. "dot".
    name: str
    # Subclass of `Problem` describing one call.
    problem_type: type
    # A kernel that supports every problem of this op; registered with the op.
    reference: Kernel
    # One line on what the op computes and its layouts.
    doc: str = ""


def _validate_op(name: str, value: Any) -> str | None:
    if not isinstance(value, Op):
        return f"expected an axcore.kernels.Op, got {value!r}"
    if not (isinstance(value.problem_type, type) and issubclass(value.problem_type, Problem)):
        return f"its problem_type must subclass axcore.kernels.Problem, got {value.problem_type!r}"
    if not isinstance(value.reference, Kernel):
        return "its reference kernel lacks name, priority, is_supported() or __call__()"
    return None


class OpRegistry(NamedRegistry[Op]):
    """Registered ops: `register(op, *, override=False)`."""

    def __init__(self, kind: str = "op", validate: Any = _validate_op):
        super().__init__(kind, validate)


def _validate_kernel(name: str, value: Any) -> str | None:
    if not isinstance(value, Kernel):
        return "expected an object with name, priority, is_supported() and __call__()"
    if value.name != name:
        return f"its name attribute is {value.name!r}"
    return None


class KernelRegistry(Registry):
    """Op name -> registry of kernels for that op; `register(op, kernel, *, override=False)`.

    `op` is an `Op` or a registered op's name. An op's reference kernel is a
    candidate even when nobody registers it.
    """

    def __init__(self, kind: str = "kernel", validate: Any = None):
        super().__init__(kind, validate)
        self._ops: dict[str, Registry[Kernel]] = {}
        self._op_registry: OpRegistry | None = None
        # (op, kernel, reason) already logged: every layer selects at trace time, so
        # a declining kernel would otherwise log once per layer and per trace.
        self._logged_declines: set[tuple[str, str, str]] = set()

    def register(self, op: Any, kernel: Kernel, provenance: Provenance, override: bool = False) -> None:
        op_name = op.name if isinstance(op, Op) else op
        if not isinstance(op_name, str) or not op_name:
            raise UnknownComponentError(f"{provenance} registered a kernel for op {op!r}; name a registered op.")
        registry = self._ops.setdefault(op_name, Registry(f"'{op_name}' kernel", _validate_kernel))
        registry.register(getattr(kernel, "name", None), kernel, provenance, override)

    def register_callback(self, provenance: Provenance):
        def register(op: Any, kernel: Kernel, *, override: bool = False) -> None:
            self.register(op, kernel, provenance, override)

        return register

    def finalize(self, registries: Registries) -> None:
        """Links the op registry, adds each op's reference kernel, rejects kernels of unknown ops."""
        ops: OpRegistry = registries.family("ops")
        self._op_registry = ops
        for op_name in list(self._ops):
            if op_name not in ops:
                first = self._ops[op_name].entry(next(iter(self._ops[op_name])))
                raise UnknownComponentError(
                    f"{first.provenance} registered kernel '{first.name}' for op '{op_name}', which no "
                    f"plugin declares{did_you_mean(op_name, ops)}; ops: {', '.join(ops.names())}. Fix "
                    f"the op name or register the op with axcore_register_ops."
                )
        for op_name in ops:
            entry = ops.entry(op_name)
            registry = self._ops.setdefault(op_name, Registry(f"'{op_name}' kernel", _validate_kernel))
            # Through `register`, so a plugin kernel named like the reference needs override=True.
            registry.register(entry.value.reference.name, entry.value.reference, entry.provenance)

    def ops(self) -> list[str]:
        return sorted(self._ops)

    def op(self, op: Any) -> Op:
        """The registered `Op` for an op object or name; raises for an unknown op."""
        if isinstance(op, Op) and self._op_registry is None:
            return op  # A bare registry (outside a plugin manager) trusts the op object.
        name = op.name if isinstance(op, Op) else op
        if self._op_registry is None or name not in self._op_registry:
            known = self._op_registry.names() if self._op_registry is not None else self.ops()
            raise UnknownComponentError(
                f"No op named '{name}'{did_you_mean(str(name), known)}; ops: {', '.join(known)}. Register "
                f"it with axcore_register_ops."
            )
        return self._op_registry[name]

    def __contains__(self, name: str) -> bool:
        return name in self._ops

    def __iter__(self):
        return iter(self._ops)

    def names(self) -> list[str]:
        return self.ops()

    def candidates(self, op: Any) -> list[Kernel]:
        """Kernels for `op` in the order `select` tries them."""
        declared = self.op(op)
        registry = self._ops.get(declared.name)
        kernels = [registry[n] for n in registry] if registry is not None else []
        if all(k.name != declared.reference.name for k in kernels):
            kernels.append(declared.reference)
        return sorted(kernels, key=lambda k: (-k.priority, k.name))

    def _named(self, declared: Op, name: str) -> Kernel:
        """The kernel of `declared` called `name` (UnknownComponentError naming the others)."""
        by_name = {k.name: k for k in self.candidates(declared)}
        if name not in by_name:
            raise UnknownComponentError(
                f"No '{declared.name}' kernel named '{name}'{did_you_mean(name, by_name)}; "
                f"kernels: {', '.join(sorted(by_name))}. Enable the plugin that provides it in `plugins:`."
            )
        return by_name[name]

    def select(self, op: Any, problem: Any, requested: str | None = None) -> Kernel:
        """The kernel to run `op` on `problem`.

        Args:
            op: the `Op` (or its registered name).
            problem: an instance of the op's problem type.
            requested: a kernel name to force; it must support the problem.

        Raises:
            UnknownComponentError: the op or the requested kernel is unknown.
            KernelNotSupportedError: the requested kernel declines, or every kernel does.
        """
        declared = self.op(op)
        if not isinstance(problem, declared.problem_type):
            raise TypeError(f"op '{declared.name}' takes a {declared.problem_type.__name__}, got {type(problem).__name__}")
        preferred = (_PREFERRED.get() or {}).get(declared.name) if requested is None else None
        if preferred is not None:
            kernel = self._named(declared, preferred)
            if kernel.is_supported(problem):
                _record_choice(declared.name, preferred, problem)
                return declared.reference if current_environment().stand_in else kernel
        if requested is not None:
            kernel = self._named(declared, requested)
            support = kernel.is_supported(problem)
            if not support:
                raise KernelNotSupportedError(
                    f"The '{declared.name}' kernel '{requested}' does not support this problem: "
                    f"{support.reason}. Remove the explicit kernel choice to fall back."
                )
            _record_choice(declared.name, kernel.name, problem, forced=True)
            return declared.reference if current_environment().stand_in else kernel
        reasons = []
        declined: list[tuple[str, str]] = []
        for kernel in self.candidates(declared):
            support = kernel.is_supported(problem)
            if support:
                _record_choice(declared.name, kernel.name, problem, tuple(declined))
                return declared.reference if current_environment().stand_in else kernel
            declined.append((kernel.name, support.reason))
            if (declared.name, kernel.name, support.reason) not in self._logged_declines:
                self._logged_declines.add((declared.name, kernel.name, support.reason))
                logger.info("'%s' kernel '%s' declined: %s", declared.name, kernel.name, support.reason)
            reasons.append(f"{kernel.name}: {support.reason}")
        raise KernelNotSupportedError(f"No '{declared.name}' kernel supports this problem ({'; '.join(reasons)}).")


def _record_choice(
    op: str, kernel: str, problem: Any, declined: tuple[tuple[str, str], ...] = (), forced: bool = False
) -> None:
    site = getattr(problem, "site", "") or "?"
    choices = _CHOICES.get()
    if choices is not None:
        choices.setdefault(op, {}).setdefault(kernel, []).append(site)
    decisions = _DECISIONS.get()
    if decisions is not None:
        decisions.append(KernelDecision(op, site, kernel, declined, forced))


def fixed_op_callback(op_name: str):
    """A `registers` callback for a hook whose `register(kernel)` always targets op `op_name`."""

    def callback(registry: KernelRegistry, provenance: Provenance):
        return lambda kernel, *, override=False: registry.register(op_name, kernel, provenance, override)

    return callback
