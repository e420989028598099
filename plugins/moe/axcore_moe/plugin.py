"""The moe plugin: the layer registration, settings and the config transform.

`plugins: [moe]` replaces the feed-forward of every `every`-th layer (layers
every-1, 2*every-1, ...) of every decoder stack with a `mixture_of_experts` whose
expert template is the replaced feed-forward (its type, hidden_dim, activation, ...
carried over, so e.g. swiglu's gated feed-forward gives SwiGLU experts):

- stacked_transformer: its `layer` template becomes a list of num_layers configs;
- repeated_transformer (scan) over one layer: the unit becomes a stacked_transformer
  block of `every` layers with the MoE in its last layer, repeated num_layers/every
  times (a ConfigError if that does not divide); a unit that already is a block must
  have a multiple of `every` layers and gets its layers replaced in place.
"""

from __future__ import annotations

from typing import Annotated

from axcore import REQUIRED, ConfigBase, hookimpl
from axcore.config import Depth, NonNegative, Positive, Width, get_path, is_config_of, replace
from axcore.errors import ConfigError
from axcore.layers import RepeatedTransformer, StackedTransformer

from axcore_moe.layer import Gates, MixtureOfExperts


class MoESettings(ConfigBase):
    """Settings of the moe plugin (the experiment's `moe:` section)."""

    # Replace the feed-forward of every `every`-th layer (layers every-1, 2*every-1, ...).
    every: Annotated[int, Depth] = 2
    # Number of experts per MoE layer.
    num_experts: Annotated[int, Width] = 8
    # Number of experts each token is routed to.
    top_k: Annotated[int, Width] = 2
    # Weights of the k chosen experts: renormalized (sum to 1) or the softmax probabilities as they are.
    gates: Gates = Gates.RENORMALIZED
    # Expert slots per sequence: ceil(capacity_factor * seq * top_k / num_experts); null never drops.
    capacity_factor: Annotated[float, Positive] | None = 1.25
    # Weight of the load-balancing loss.
    load_balance_loss_weight: Annotated[float, NonNegative] = 0.01
    # Weight of the router z-loss.
    router_z_loss_weight: Annotated[float, NonNegative] = 1e-3


@hookimpl
def axcore_register_layers(register):
    register("mixture_of_experts", MixtureOfExperts)


@hookimpl
def axcore_settings_config():
    return MoESettings()


@hookimpl
def axcore_transform_config(config, settings):
    def install(path, stack):
        n = stack.num_layers  # Usually left to the parent: CausalLM passes its own num_layers at build time.
        n = get_path(config, path.rpartition(".")[0]).num_layers if n is REQUIRED else n
        if is_config_of(stack, StackedTransformer):
            return _sparsify(stack, n, settings, path)
        unit = stack.layer  # Scanned: repeat a block whose last layer has the MoE.
        if not is_config_of(unit, StackedTransformer):
            unit = StackedTransformer.default_config().set(num_layers=settings.every, layer=unit)
        block = _sparsify(unit, unit.num_layers, settings, f"{path}.layer")
        if n % unit.num_layers or unit.num_layers % settings.every:
            raise ConfigError(f"moe: '{path}' scans a block of {unit.num_layers} layers over num_layers={n}; "
                              f"both must be multiples of moe.every={settings.every}.")
        return stack.set(layer=block)

    decoders = (StackedTransformer, RepeatedTransformer)
    return replace(config, lambda _, node: any(is_config_of(node, d) for d in decoders), install)


def _sparsify(stack, num_layers, settings, path):
    """`stack` with one config per layer and the feed-forward of layers every-1, 2*every-1, ... an MoE."""
    if not 1 <= settings.every <= num_layers:
        raise ConfigError(f"moe: moe.every={settings.every} must be between 1 and the {num_layers} layers of '{path}'.")
    layers = stack.layer if isinstance(stack.layer, list) else [stack.layer.clone() for _ in range(num_layers)]
    moe = {k: v for k, v in settings.items() if k != "every"}
    for i in range(settings.every - 1, len(layers), settings.every):
        ffn = layers[i].feed_forward  # Becomes the expert template; the MoE sets its hidden_dim.
        if not is_config_of(ffn, MixtureOfExperts):  # Else installed already (a resolved config read back).
            layers[i].feed_forward = MixtureOfExperts.default_config().set(
                hidden_dim=ffn.hidden_dim, expert=ffn.clone(hidden_dim=REQUIRED), **moe)
    return stack.set(layer=layers)
