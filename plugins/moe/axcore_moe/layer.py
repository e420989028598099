"""MixtureOfExperts: a feed-forward layer whose tokens are routed to top-k of E experts.

GShard (Lepikhin et al. 2020) / Switch Transformer (Fedus et al. 2021) style, with
static shapes throughout (one-hot dispatch and combine einsums), so it works
under `jit`, `grad` and inside a `lax.scan` over layers.

For x `[batch, seq, dim]`, per token and in float32:

    probs   = softmax(x @ router)                          [batch, seq, E]
    top_k   = the k largest probs p_1..p_k, experts e_1..e_k
    gates   = p_j / (p_1 + ... + p_k)                      (gates=renormalized: sum to 1, as Mixtral;
                                                            == softmax over the k top logits)
            = p_j                                          (gates=probabilities: Qwen3-MoE's
                                                            norm_topk_prob false)
    y       = sum over kept j of gates_j * expert_{e_j}(x)

Capacity. Each expert has `capacity = min(seq, ceil(capacity_factor * seq * k / E))`
slots per *sequence* (the group is one sequence, so dispatch never crosses batch
rows and batch sharding stays local). Slots are given in position order: the
(token, choice) assignments to an expert are ranked by token position, then by
choice rank, and the ones ranked at or past `capacity` are dropped for that expert
(they contribute 0; the other choices of the token still count, with their gates
unchanged). Whether a token is dropped thus depends only on it and the tokens
before it, so the layer stays causal. `capacity_factor=None` never drops (capacity = seq,
as imported Mixtral and Qwen3-MoE models need for parity with transformers); the one-hot
dispatch and combine then hold `[batch, seq, E, seq]` values, E x seq^2 per sequence.

Auxiliary losses, over all tokens of the batch (before dropping):

    load_balance = E * sum_e f_e * P_e,  f_e = fraction of the batch's top-k
                   assignments that go to e (sum_e f_e = 1), P_e = mean prob of e
    router_z     = mean(logsumexp(router logits)^2)

Their weighted sum is recorded as the module output `aux_loss` (CausalLM adds it
to the loss); each unweighted part and the dropped fractions are summaries.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Annotated, NamedTuple

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, InstantiableConfig, NonNegative, Positive, Width
from axcore.errors import ConfigError
from axcore.kernels import current_environment, op_environment
from axcore.layers import BaseLayer, FeedForward, with_fields
from axcore.layers.base import DotSite
from axcore.layers.transformer import StackedInitializer
from axcore.module import functional, no_context
from axcore.params import FanAxes, ParameterSpec, fold_in_name
from axcore.platform.sharding import mesh_axes_of, resolve_rules

# Logical axes of the experts' inputs and outputs `[num_experts, batch, capacity, dim]` (sharding constraint).
EXPERT_IO_AXES = ("expert", "batch", None, "embed")


class Gates(enum.Enum):
    """How the k chosen experts' outputs are weighted (the module docstring's `gates`)."""

    # Their probabilities divided by their sum (sum to 1): GShard, Switch, Mixtral, norm_topk_prob true.
    RENORMALIZED = "renormalized"
    # Their softmax probabilities over all experts as they are (sum <= 1): Qwen-MoE's norm_topk_prob false.
    PROBABILITIES = "probabilities"


class Routing(NamedTuple):
    """What the router decided for x `[batch, seq, dim]`, with k = top_k and E = num_experts."""

    # Router logits `[batch, seq, E]`, float32.
    logits: jax.Array
    # softmax(logits) `[batch, seq, E]`.
    probs: jax.Array
    # The k chosen experts per token, by descending probability `[batch, seq, k]`.
    experts: jax.Array
    # Their weights `[batch, seq, k]` (Config.gates: renormalized to sum to 1, or the probabilities).
    gates: jax.Array
    # Rank of each assignment among its sequence's assignments to that expert `[batch, seq, k]`.
    slot: jax.Array
    # Whether the assignment got a slot (slot < capacity) `[batch, seq, k]`.
    kept: jax.Array


class MixtureOfExperts(BaseLayer):
    """x `[batch, seq, input_dim]` -> `[batch, seq, input_dim]` through top-k of `num_experts` experts."""

    class Config(BaseLayer.Config):
        """Configures MixtureOfExperts."""

        # Model dimension (input and output).
        input_dim: Annotated[int, Width] = REQUIRED
        # Hidden dimension of each expert (set on the expert template's hidden_dim).
        hidden_dim: Annotated[int, Width] = REQUIRED
        # Number of experts.
        num_experts: Annotated[int, Width] = 8
        # Number of experts each token is routed to.
        top_k: Annotated[int, Width] = 2
        # Template of one expert: a layer `[..., input_dim] -> [..., input_dim]` with
        # input_dim and hidden_dim fields (e.g. feed_forward, or swiglu's gated_feed_forward); this layer
        # sets both, and stacks its parameters on a leading "expert" axis.
        expert: InstantiableConfig = FeedForward.default_config()
        # Weights of the k chosen experts: renormalized to sum to 1, or their probabilities as they are.
        gates: Gates = Gates.RENORMALIZED
        # Slots per expert per sequence: ceil(capacity_factor * seq * top_k / num_experts); None never drops.
        capacity_factor: Annotated[float, Positive] | None = 1.25
        # Weight of the load-balancing loss in `aux_loss`.
        load_balance_loss_weight: Annotated[float, NonNegative] = 0.01
        # Weight of the router z-loss in `aux_loss`.
        router_z_loss_weight: Annotated[float, NonNegative] = 1e-3

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        if not 1 <= cfg.top_k <= cfg.num_experts:
            raise ConfigError(f"{self.path}: top_k ({cfg.top_k}) must be in [1, num_experts={cfg.num_experts}].")
        if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
            raise ConfigError(f"{self.path}: capacity_factor must be positive or null, got {cfg.capacity_factor}.")
        self._add_child("expert", with_fields(cfg.expert, input_dim=cfg.input_dim, hidden_dim=cfg.hidden_dim))

    @no_context
    def capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence of `seq_len` tokens."""
        cfg = self._config
        if cfg.capacity_factor is None:
            return seq_len
        return min(seq_len, math.ceil(cfg.capacity_factor * seq_len * cfg.top_k / cfg.num_experts))

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        shape = (self._config.input_dim, self._config.num_experts)
        return {"router": self._weight(shape, ("embed", None), FanAxes((0,), (1,)))}

    def _dot_sites(self) -> dict[str, DotSite]:
        return {"router": DotSite("router", (0,), "float32", "float32", x_axes=("batch", "seq", "embed"))}

    def parameter_specs(self) -> dict:
        """The router, and the expert template's tree stacked on a leading `[num_experts]` axis."""
        specs = super().parameter_specs()
        n = self._config.num_experts

        def stack(spec: ParameterSpec) -> ParameterSpec:
            axes = ("expert", *(spec.mesh_axes or (None,) * len(spec.shape)))
            init = StackedInitializer(spec.initializer)
            return dataclasses.replace(spec, shape=(n, *spec.shape), initializer=init, mesh_axes=axes)

        specs["expert"] = jax.tree.map(stack, specs["expert"])
        return specs

    def route(self, x: jax.Array) -> Routing:
        """Router decisions for x `[batch, seq, input_dim]` (see the module docstring)."""
        cfg = self._config
        logits = self._dot("router", x)  # float32: routing decisions are precision-sensitive.
        probs = jax.nn.softmax(logits, axis=-1)
        top_probs, experts = jax.lax.top_k(probs, cfg.top_k)
        assign = jax.nn.one_hot(experts, cfg.num_experts, dtype=jnp.int32)  # [b, t, k, e]
        # Rank of each assignment among its sequence's assignments to the same expert,
        # ordered by (position, choice rank); ranks past the capacity are dropped.
        ranks = jnp.cumsum(assign.reshape(x.shape[0], -1, cfg.num_experts), axis=1).reshape(assign.shape) - 1
        slot = jnp.sum(ranks * assign, axis=-1)
        gates = top_probs
        if cfg.gates is Gates.RENORMALIZED:
            gates = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
        return Routing(logits, probs, experts, gates, slot, slot < self.capacity(x.shape[1]))

    def forward(self, x: jax.Array) -> jax.Array:
        cfg = self._config
        r = self.route(x)
        capacity = self.capacity(x.shape[1])
        assign = jax.nn.one_hot(r.experts, cfg.num_experts, dtype=jnp.float32)  # [b, t, k, e]
        slots = jax.nn.one_hot(jnp.where(r.kept, r.slot, capacity), capacity, dtype=jnp.float32)  # [b, t, k, c]
        dispatch = jnp.einsum("btke,btkc->btec", assign, slots)
        combine = jnp.einsum("btke,btkc,btk->btec", assign, slots, r.gates)
        expert_in = self._constrain(jnp.einsum("btec,btd->ebcd", dispatch.astype(x.dtype), x), EXPERT_IO_AXES)
        expert_out = self._constrain(self._experts(expert_in), EXPERT_IO_AXES)
        y = jnp.einsum("btec,ebcd->btd", combine.astype(x.dtype), expert_out)

        fraction = jnp.mean(assign, axis=(0, 1, 2))  # f_e: share of the top-k assignments.
        load_balance = cfg.num_experts * jnp.sum(fraction * jnp.mean(r.probs, axis=(0, 1)))
        router_z = jnp.mean(jnp.square(jax.nn.logsumexp(r.logits, axis=-1)))
        self.add_module_output(
            "aux_loss", cfg.load_balance_loss_weight * load_balance + cfg.router_z_loss_weight * router_z
        )
        self.add_summary("load_balance_loss", load_balance)
        self.add_summary("router_z_loss", router_z)
        self.add_summary("dropped_assignment_fraction", 1.0 - jnp.mean(r.kept, dtype=jnp.float32))
        self.add_summary("dropped_token_fraction", 1.0 - jnp.mean(jnp.any(r.kept, axis=-1), dtype=jnp.float32))
        return y

    def _experts(self, xs: jax.Array) -> jax.Array:
        """Expert i applied to `xs[i]`: `[num_experts, ...]` -> `[num_experts, ...]` (vmapped).

        Under a mesh the vmapped axis is split over the mesh axes of logical axis "expert"
        (`spmd_axis_name`), so the experts' own sharding constraints keep it sharded; those
        mesh axes are removed from the rules the experts see (one mesh axis cannot shard
        two dims of an array).
        """
        env = current_environment()
        expert_axes = mesh_axes_of("expert", env.axis_rules, env.mesh) if env.mesh is not None else ()
        if not expert_axes:
            return self._run_experts(xs, None)
        inner = {
            logical: None if target is None else tuple(a for a in target if a not in expert_axes)
            for logical, target in resolve_rules(env.axis_rules).items()
        }
        with op_environment(env.mesh, inner):
            return self._run_experts(xs, expert_axes)

    def _run_experts(self, xs: jax.Array, spmd_axis_name: tuple[str, ...] | None) -> jax.Array:
        ctx = self._context()
        key = fold_in_name(ctx.prng_key, "expert")
        keys = None if key is None else jax.random.split(key, self._config.num_experts)

        def one(params, x, key):
            return functional(self.expert, params, (x,), key, ctx.is_training)

        out, collections = jax.vmap(one, spmd_axis_name=spmd_axis_name)(ctx.state["expert"], xs, keys)
        for mine, stacked in zip(ctx.output_collection.child("expert"), collections):
            mine.update(stacked)
        return out
