"""Mesh rules for Trainium instance types `neuron-(trn1|trn2)-N` (and the v2/v3d/v3 spellings).

Layout: tensor parallelism within a node, fully sharded data parallelism across the
rest. The mesh is `(fsdp, tensor)`: query/key-value heads, the feed-forward hidden
dimension and the vocabulary are split over `tensor`; the model dimension of every
weight (so parameters and optimizer state, ZeRO-3 style) and the batch over `fsdp`.

Why: Trainium users run Megatron-style tensor parallelism inside a node, where the
NeuronCores are linked by NeuronLink, and data parallelism with sharded optimizer
state across nodes over EFA: NeuronX Distributed trains Llama-3-8B on trn1.32xlarge
with TP=32 (the whole node) and ZeRO-1 (examples/training/llama/tp_zero1_llama_hf_pretrain),
and AXLearn's trn2 rules use `fsdp=-1, model=4` ("TP within the chip, FSDP across
chips", axlearn/experiments/text/gpt/fuji.py). Per-core memory is small (16 GB on
trn1, 24 GB per logical core on trn2), so the data-parallel axis shards parameters too.

The tensor degree (`tensor_parallel`): at most one node's cores (32 on trn1, 64 on trn2
with LNC=2, 128 with LNC=1) and at most N, and it must divide every tensor-sharded
parameter dimension, because axcore shards parameters strictly and does not replicate
key/value heads the way NeuronX Distributed's `kv_replicator` does. So the rule takes
the largest degree that fits: the default 4-head model gets 4, a Llama-3-shaped model
(8 key/value heads) 8, a model whose every tensor dimension divides 32 gets the whole
trn1 node, as NeuronX Distributed runs it. The degree always divides a node's cores,
so no tensor-parallel group straddles two nodes.

Config modifiers, in order:
- `neuron_tensor_parallel()`: the tensor degree above (mesh.mesh_shape `[-1, degree]`).
- `compute_dtype(compute='bfloat16', override=False)`: bfloat16 activations and matmuls
  unless the experiment chose a compute dtype; parameters and optimizer state stay
  float32 master weights (`param_dtype` untouched).
- `neuron_remat(policy='full')`: every transformer layer recomputes its forward pass in
  the backward pass (`nothing_saveable`), unless the experiment set a remat policy
  anywhere in the model. Chosen for memory: with the tensor degree capped by the
  key/value heads and no sequence parallelism, activations per core are larger than in
  NeuronX Distributed's TP=32 runs, which use selective checkpointing; AXLearn's trn2
  rules remat with `nothing_saveable` as well. It costs about one more forward pass
  per step; a model small enough not to need it can have its own `mesh_rules:` entry.

The attention kernel is left to the registry: this package has no NKI kernel yet (see
README), so the XLA reference runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterator
from typing import Any, Literal

from axcore.config import InstantiableConfig, get_path, walk
from axcore.errors import ConfigError
from axcore.experiment.config_modifiers import REMAT_POLICIES, Modifier, compute_dtype, matching_configs
from axcore.params import ParameterSpec
from axcore.platform.mesh import MeshRule
from axcore.platform.sharding import resolve_rules

from axcore_neuron.instance_types import TRN1, TRN2, TRN2_LNC1, NeuronKind, require_instance_type

logger = logging.getLogger(__name__)

# Mesh axes of every Trainium rule: fully sharded data parallelism, then tensor parallelism.
MESH_AXES = ("fsdp", "tensor")
# Logical axis -> mesh axis (spelled out over axcore's defaults, which agree).
AXIS_RULES = {
    "batch": "fsdp",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
}
# Above the default rule (-1000); room below for broader rules, above for model-specific layouts.
NEURON_RULE_PRIORITY = 10
# (rule name, instance types, kind): trn2 is LNC=2, the Neuron default; v3 is trn2 with LNC=1.
RULES: tuple[tuple[str, str, NeuronKind], ...] = (
    ("neuron-trn1", r"neuron-(trn1|v2)-\d+", TRN1),
    ("neuron-trn2", r"neuron-(trn2|v3d)-\d+", TRN2),
    ("neuron-trn2-lnc1", r"neuron-v3-\d+", TRN2_LNC1),
)


def _registries(registries: Any) -> Any:
    if registries is not None:
        return registries
    from axcore.experiment.builtins import builtin_registries  # Deferred: only when called without a manager.

    return builtin_registries()


def _own_parameter_specs(module: Any) -> Iterator[tuple[str, ParameterSpec]]:
    """`(path, spec)` of every module's own parameters, the model's kernel state left out.

    Not `parameter_specs()`: declaring kernel state asks each dot site's kernel, whose
    problem names JAX's default backend, which would start one during resolution. Stacked
    layers (scan, experts) contribute their unit's specs: the leading axis they add
    (`layers`, `expert`) is never a tensor axis.
    """
    for name, spec in module._create_parameter_specs().items():
        yield f"{module.path}.{name}", spec
    for child in module.children.values():
        yield from _own_parameter_specs(child)


def tensor_dimensions(modifier: Modifier, config: Any, registries: Any) -> list[tuple[str, int, str, int]]:
    """`(parameter, dim, logical axis, size)` of every parameter dimension the mesh's axis rules put on `tensor`.

    Builds the model (modules hold no arrays; no backend starts) and reads its layers' parameter specs.
    """
    model_config = getattr(config, "model", None)
    if not isinstance(model_config, InstantiableConfig):
        raise ConfigError(f"Config modifier {modifier}: the config ({type(config).__name__}) has no model to lay out.")
    model = model_config.instantiate(name="model", registries=_registries(registries))
    rules = resolve_rules(config.mesh.axis_rules)
    found = []
    for name, spec in _own_parameter_specs(model):
        for dim, (logical, size) in enumerate(zip(spec.mesh_axes or (), spec.shape)):
            if logical is not None and "tensor" in (rules.get(logical) or ()):
                found.append((name, dim, logical, size))
    return found


def tensor_parallel(degree: int | None = None) -> Modifier:
    """Sets the `tensor` entry of mesh.mesh_shape for a `neuron-<kind>-N` instance type.

    Args:
        degree: None picks the largest degree that divides one node's cores, N and every
            tensor-sharded parameter dimension (module docstring). A number asks for
            exactly that degree and raises a ConfigError now, at resolution, when it does
            not divide N, one node's cores or a parameter dimension (naming it), rather
            than when the parameters are sharded on the devices.
    """
    this = Modifier("neuron_tensor_parallel", {} if degree is None else {"degree": degree})
    if degree is not None and (not isinstance(degree, int) or isinstance(degree, bool) or degree < 1):
        raise ConfigError(f"Config modifier {this}: degree must be a positive integer (or null to fit it).")

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        kind, count = require_instance_type(config.mesh.instance_type, f"Config modifier {self}")
        names = tuple(config.mesh.mesh_axis_names or ())
        if names.count("tensor") != 1 or len(names) != len(config.mesh.mesh_shape or ()):
            raise ConfigError(
                f"Config modifier {self}: the mesh needs one 'tensor' axis, got axes {list(names)} and shape "
                f"{list(config.mesh.mesh_shape or ())}."
            )
        dims = tensor_dimensions(self, config, registries)
        limit = math.gcd(kind.cores_per_node, count)
        if degree is None:
            chosen = math.gcd(limit, *(size for *_, size in dims))
            if chosen < limit:
                limiting = sorted({f"{logical}={size}" for _, _, logical, size in dims if size % limit})
                logger.info(
                    "%s: tensor degree %d for %s (up to %d), limited by %s.",
                    self, chosen, config.mesh.instance_type, limit, ", ".join(limiting),
                )
        else:
            chosen = degree
            if limit % degree:
                raise ConfigError(
                    f"Config modifier {self}: degree {degree} must divide both the {count} devices of "
                    f"{config.mesh.instance_type} and one node's {kind.cores_per_node} NeuronCores (tensor "
                    f"parallelism within a node); use a divisor of {limit}."
                )
            for name, dim, logical, size in dims:
                if size % degree:
                    raise ConfigError(
                        f"Config modifier {self}: {name} dim {dim} ('{logical}') of size {size} is not divisible by "
                        f"tensor degree {degree}; use a degree dividing {size}, or change the model."
                    )
        new = config.clone()
        shape = list(config.mesh.mesh_shape)
        shape[names.index("tensor")] = chosen
        new.mesh.mesh_shape = tuple(shape)
        return new

    return dataclasses.replace(this, fn=fn)


def remat_transformer_layers(policy: Literal["none", "full", "save_matmul_outputs"] = "full") -> Modifier:
    """Sets `remat_policy` on every (outermost) transformer layer, unless the experiment set a remat policy.

    Policies as axcore's `remat` modifier: `full` keeps only each layer's input,
    `save_matmul_outputs` the outputs of its weight matmuls too, `none` changes nothing.

    Raises:
        NoMatchError: the model has no transformer layer.
    """
    this = Modifier("neuron_remat", {"policy": policy})
    if policy not in REMAT_POLICIES:
        raise ConfigError(f"Config modifier {this}: policy must be one of {list(REMAT_POLICIES)}.")
    value = REMAT_POLICIES[policy]

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        from axcore.layers.transformer import TransformerLayer

        if value is None or any(p.endswith("remat_policy") and v is not None for p, v in walk(config.model, "model")):
            return config  # Nothing asked, or the experiment chose its own rematerialization.
        targets = matching_configs(
            self, config, _registries(registries), re.compile(".*"), TransformerLayer, "transformer layer", outermost=True
        )
        new = config.clone()
        for path in targets:
            get_path(new, path).remat_policy = value
        return new

    return dataclasses.replace(this, fn=fn)


def neuron_mesh_rules() -> list[MeshRule]:
    """The rules this plugin registers (`RULES`), each with the modifiers of the module docstring."""
    return [
        MeshRule(
            name=name,
            instance_type=pattern,
            mesh_shape=(-1, kind.cores_per_node),
            mesh_axis_names=MESH_AXES,
            axis_rules=AXIS_RULES,
            config_modifiers=(
                tensor_parallel(),
                compute_dtype("bfloat16", override=False),
                remat_transformer_layers("full"),
            ),
            priority=NEURON_RULE_PRIORITY,
        )
        for name, pattern, kind in RULES
    ]


# Registered by name, for an experiment's own `mesh_rules[i].modifiers` ({type: neuron_tensor_parallel, degree: 8}).
CONFIG_MODIFIERS = {"neuron_tensor_parallel": tensor_parallel, "neuron_remat": remat_transformer_layers}
