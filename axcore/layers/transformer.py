"""Pre-norm transformer layer and layer stacks (unrolled, or scanned over stacked params).

`TransformerLayer`'s public parameter names are those of its children:
`attention_norm`, `self_attention` (`wq`, `wk`, `wv`, `wo`, see
`axcore.layers.attention`), `ffn_norm` and `feed_forward` (`up_proj`, `down_proj`,
see `axcore.layers.feed_forward`). Its forward is two named residual steps a
subclass may override: `attention_block(x, **kwargs)` and `ffn_block(x)`.

Both stacks take `x [batch, seq, input_dim]` and keyword arguments that they pass
to every layer (`positions`, `kv_mask`). For the same parameters (the scanned stack
holds each unrolled layer's tree stacked on a leading `num_layers` axis) they give
the same numbers.

Per-layer attention patterns: `StackedTransformer.layer_types` names each layer's
attention type, and `attention_types` maps a type to the self-attention fields its
layers set over `layer`'s (dotted paths: `sliding_window`, `position_embedding.theta`
for a RoPE base per type, ...), applied when the stack is built, so they also hold
over the config transforms of feature plugins (e.g. the position embedding `rope`
installs). A scanned stack repeats a pattern as a `stacked_transformer` unit with
its own `layer_types` (one period of the pattern).

Incremental decoding: every layer and stack has `init_cache(batch, max_len)` (no
parameters needed) and `extend(x, cache, *, positions) -> (x, cache)`, the forward
with the attention's keys and values kept in a KV cache (see
`MultiheadAttention.extend` for the prefill and step forms). A stack's cache nests
like its parameters (`layer0`, ... or one `layer` tree with a leading repeats axis).
The inference engine's paged form is `init_paged_cache(num_blocks, block_size)` and
`extend_paged(x, cache, *, positions, num_new, block_tables) -> (x, cache)`
(`MultiheadAttention.extend_paged`), nested the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, Depth, InstantiableConfig, Probability, Width
from axcore.config.traversal import get_path
from axcore.errors import ConfigError, did_you_mean
from axcore.kernels.registry import current_environment, op_environment
from axcore.layers.attention import MultiheadAttention, decoding_into
from axcore.layers.base import BaseLayer, checkpoint_policy, with_fields
from axcore.layers.basic import RMSNorm
from axcore.layers.feed_forward import FeedForward
from axcore.layers.pipeline import (
    PipelineSchedule,
    checked_table,
    merge_microbatches,
    run_pipeline,
    split_microbatches,
    stage_count,
)
from axcore.module import functional, no_context
from axcore.params import Initializer, ParameterSpec, fold_in_name

# Logical axes of the residual stream `[batch, seq, dim]` (its sharding constraint at layer boundaries).
RESIDUAL_AXES = ("batch", "seq", "embed")


class TransformerLayer(BaseLayer):
    """x + attn(norm(x)), then + ffn(norm(x)); optional residual dropout.

    With `post_norms` (sandwich norms) each sublayer's output is normalized
    too before the residual add: x + post_norm(attn(norm(x))).

    Children (public names): `attention_norm`, `self_attention`, `ffn_norm`, `feed_forward`,
    and with `post_norms` `post_attention_norm`, `post_ffn_norm`.
    """

    class Config(BaseLayer.Config):
        """Configures TransformerLayer."""

        # Model dimension.
        input_dim: Annotated[int, Width] = REQUIRED
        # Normalization before each sublayer (e.g. rms_norm or layer_norm).
        norm: InstantiableConfig = RMSNorm.default_config()
        # Self-attention sublayer.
        self_attention: InstantiableConfig = MultiheadAttention.default_config()
        # Feed-forward sublayer (any component mapping [.., dim] to [.., dim] fits).
        feed_forward: InstantiableConfig = FeedForward.default_config()
        # Dropout rate on each sublayer's output, in training only.
        dropout_rate: Annotated[float, Probability] = 0.0
        # Sandwich norms: also normalize each sublayer's output (with `norm`) before the residual add.
        post_norms: bool = False

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        dim = cfg.input_dim
        self.add_child("attention_norm", with_fields(cfg.norm, input_dim=dim))
        self.add_child("self_attention", with_fields(cfg.self_attention, input_dim=dim))
        self.add_child("ffn_norm", with_fields(cfg.norm, input_dim=dim))
        self.add_child("feed_forward", with_fields(cfg.feed_forward, input_dim=dim))
        if cfg.post_norms:
            self.add_child("post_attention_norm", with_fields(cfg.norm, input_dim=dim))
            self.add_child("post_ffn_norm", with_fields(cfg.norm, input_dim=dim))

    def _dropout(self, x: jax.Array, name: str) -> jax.Array:
        rate = self._config.dropout_rate
        if not self.is_training or rate == 0.0:
            return x
        if self.prng_key is None:
            raise ValueError(f"{self.path}: dropout in training needs a prng_key.")
        keep = jax.random.bernoulli(fold_in_name(self.prng_key, name), 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)

    def forward(self, x: jax.Array, **kwargs) -> jax.Array:
        """x `[batch, seq, input_dim]` -> the same shape; input and output carry the sharding
        constraint of `RESIDUAL_AXES`."""
        x = self._constrain(x, RESIDUAL_AXES)
        x = self.attention_block(x, **kwargs)
        return self._constrain(self.ffn_block(x), RESIDUAL_AXES)

    def attention_block(self, x: jax.Array, **kwargs) -> jax.Array:
        """Step 1: `x + dropout(self_attention(attention_norm(x), **kwargs))`, with `post_norms`
        `post_attention_norm` applied to the attention's output; `[b, t, dim]` -> the same.

        `kwargs` (`positions`, `kv_mask`, `segment_ids`) go to the attention.
        """
        h = self.self_attention(self.attention_norm(x), **kwargs)
        if "post_attention_norm" in self.children:
            h = self.post_attention_norm(h)
        return x + self._dropout(h, "attention_dropout")

    def ffn_block(self, x: jax.Array) -> jax.Array:
        """Step 2: `x + dropout(feed_forward(ffn_norm(x)))`, with `post_norms` `post_ffn_norm`
        applied to the feed-forward's output; `[b, t, dim]` -> the same."""
        h = self.feed_forward(self.ffn_norm(x))
        if "post_ffn_norm" in self.children:
            h = self.post_ffn_norm(h)
        return x + self._dropout(h, "ffn_dropout")

    @no_context
    def init_cache(self, batch: int, max_len: int) -> dict:
        """The self-attention's empty KV cache (`MultiheadAttention.init_cache`)."""
        attention = self.self_attention
        if not hasattr(attention, "init_cache"):
            raise TypeError(
                f"{attention.path}: {type(attention).__name__} has no KV cache (init_cache/extend), so this "
                f"model cannot decode incrementally; derive the attention from MultiheadAttention."
            )
        return attention.init_cache(batch, max_len)

    def extend(self, x: jax.Array, cache: dict, *, positions: jax.Array) -> tuple[jax.Array, dict]:
        """`forward` for new tokens against the KV cache: x `[b, t, dim]` -> `(same shape, cache)`.

        Runs this layer's own `forward` (its named steps, or a subclass's overrides of
        them) with the self-attention redirected to the cache (`decoding_into`), so
        decoding computes what training computes.
        """
        return self._decode(x, cache, positions, None)

    @no_context
    def init_paged_cache(self, num_blocks: int, block_size: int) -> dict:
        """The self-attention's empty paged KV cache (`MultiheadAttention.init_paged_cache`)."""
        attention = self.self_attention
        if not hasattr(attention, "init_paged_cache"):
            raise TypeError(
                f"{attention.path}: {type(attention).__name__} has no paged KV cache (init_paged_cache/extend_paged), "
                f"so the inference engine cannot run this model; derive the attention from MultiheadAttention."
            )
        return attention.init_paged_cache(num_blocks, block_size)

    def extend_paged(
        self, x: jax.Array, cache: dict, *, positions: jax.Array, layer_index: jax.Array | None = None, **paged
    ) -> tuple[jax.Array, dict]:
        """`extend` over a paged KV cache (`MultiheadAttention.extend_paged`; `paged`: num_new, block_tables):
        x `[b, t, dim]` -> `(same shape, cache)`."""
        return self._decode(x, cache, positions, {**paged, "layer_index": layer_index})

    def _decode(self, x: jax.Array, cache: dict, positions: jax.Array, paged: dict | None) -> tuple[jax.Array, dict]:
        """This layer's `forward` with the self-attention on `cache` (paged when `paged` is given)."""
        with decoding_into(self.self_attention, cache, paged) as slot:
            y = self.forward(x, positions=positions)
        if slot.cache is cache:
            raise TypeError(
                f"{self.path}: decoding ran {type(self).__name__}.forward but its self_attention was never called, "
                f"so the KV cache was not written; call self.self_attention in forward or attention_block."
            )
        return y, slot.cache


class StackedTransformer(BaseLayer):
    """`num_layers` layers applied in sequence, as children `layer0`, `layer1`, ..."""

    class Config(BaseLayer.Config):
        """Configures StackedTransformer."""

        # Model dimension.
        input_dim: Annotated[int, Width] = REQUIRED
        # Number of layers.
        num_layers: Annotated[int, Depth] = REQUIRED
        # One config used for every layer, or a list with one config per layer.
        layer: InstantiableConfig | list[InstantiableConfig] = TransformerLayer.default_config()
        # Attention type of each layer (names of attention_types, e.g. [local, local, global]); None = none.
        layer_types: list[str] | None = None
        # Per attention type, self_attention fields (dotted paths) its layers set over `layer`'s, e.g.
        # {local: {sliding_window: 512, position_embedding.theta: 10000.0}}; read with layer_types.
        attention_types: dict[str, dict[str, Any]] | None = None

        def check_fields(self) -> list[tuple[str, str]]:
            return attention_pattern_problems(self.layer_types, self.attention_types, self.num_layers)

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        layers = cfg.layer if isinstance(cfg.layer, list) else [cfg.layer] * cfg.num_layers
        if len(layers) != cfg.num_layers:
            raise ConfigError(
                f"{self.path}: 'layer' lists {len(layers)} configs but num_layers is {cfg.num_layers}."
            )
        problems = attention_pattern_problems(cfg.layer_types, cfg.attention_types, cfg.num_layers)
        if problems:
            raise ConfigError(f"'{self.path}.{problems[0][0]}' {problems[0][1]}.")
        if cfg.layer_types is not None:
            layers = [
                with_attention_type(layer_cfg, cfg.attention_types[name], f"{self.path}.attention_types.{name}")
                for layer_cfg, name in zip(layers, cfg.layer_types)
            ]
        for i, layer_cfg in enumerate(layers):
            self._add_child(f"layer{i}", with_fields(layer_cfg, input_dim=cfg.input_dim))

    def forward(self, x: jax.Array, **kwargs) -> jax.Array:
        for i in range(self._config.num_layers):
            x = getattr(self, f"layer{i}")(x, **kwargs)
        return x

    @no_context
    def init_cache(self, batch: int, max_len: int) -> dict:
        """`{"layer0": cache, ...}`, each layer's empty KV cache."""
        return {f"layer{i}": getattr(self, f"layer{i}").init_cache(batch, max_len) for i in range(self._config.num_layers)}

    def extend(self, x: jax.Array, cache: dict, *, positions: jax.Array) -> tuple[jax.Array, dict]:
        """Each layer's `extend` in sequence: x `[b, t, dim]` -> `(same shape, cache)`."""
        new = {}
        for i in range(self._config.num_layers):
            x, new[f"layer{i}"] = getattr(self, f"layer{i}").extend(x, cache[f"layer{i}"], positions=positions)
        return x, new

    @no_context
    def init_paged_cache(self, num_blocks: int, block_size: int) -> dict:
        """`{"layer0": cache, ...}`, each layer's empty paged KV cache."""
        n = self._config.num_layers
        return {f"layer{i}": getattr(self, f"layer{i}").init_paged_cache(num_blocks, block_size) for i in range(n)}

    def extend_paged(self, x: jax.Array, cache: dict, **paged: jax.Array) -> tuple[jax.Array, dict]:
        """Each layer's `extend_paged` in sequence (`paged`: positions, num_new, block_tables): x `[b, t, dim]`
        -> `(same shape, cache)`."""
        new = {}
        for i in range(self._config.num_layers):
            x, new[f"layer{i}"] = getattr(self, f"layer{i}").extend_paged(x, cache[f"layer{i}"], **paged)
        return x, new


def attention_pattern_problems(
    layer_types: list[str] | None, attention_types: Mapping[str, Any] | None, num_layers: Any
) -> list[tuple[str, str]]:
    """`(field, problem)` pairs of a stack's `layer_types` / `attention_types` (empty when consistent)."""
    if layer_types is None:
        if attention_types:
            return [("attention_types", "is set but layer_types is not; list each layer's attention type")]
        return []
    if isinstance(num_layers, int) and len(layer_types) != num_layers:
        return [("layer_types", f"lists {len(layer_types)} types but num_layers is {num_layers}; give one per layer")]
    known = attention_types or {}
    for i, name in enumerate(layer_types):
        if name not in known:
            return [(
                f"layer_types[{i}]",
                f"is {name!r}, which attention_types does not define{did_you_mean(name, known)} (defined: "
                f"{', '.join(known) or 'none'})",
            )]
    return []


def with_attention_type(layer: InstantiableConfig, fields: Mapping[str, Any], where: str) -> InstantiableConfig:
    """A copy of the layer config `layer` whose `self_attention` has `fields` (dotted paths -> values) set.

    Raises ConfigError naming `where.<path>` when the attention config has no such field.
    """
    layer = layer.clone()
    attention = layer.self_attention
    for path, value in fields.items():
        *parents, name = path.split(".")
        try:
            node = get_path(attention, ".".join(parents)) if parents else attention
            if node is None or name not in node.keys():
                raise ConfigError(f"{type(node).__name__} has no field {name!r}")
            setattr(node, name, value)
        except (ConfigError, AttributeError, ValueError, TypeError) as e:
            raise ConfigError(
                f"{where}.{path}: cannot set the self_attention field ({e}); name a field of the layer's "
                f"self_attention config, e.g. sliding_window or position_embedding.theta."
            ) from None
    return layer


@dataclasses.dataclass(frozen=True)
class StackedInitializer:
    """Draws `shape[0]` independent values of `inner` (one per layer) and stacks them."""

    inner: Initializer

    def __call__(self, key, shape, dtype):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda k: self.inner(k, shape[1:], dtype))(keys)


class RepeatedTransformer(BaseLayer):
    """A unit (one layer, or a block of layers) applied repeatedly with `jax.lax.scan`.

    The unit is the child `layer`. If its config has a `num_layers` field (a
    `StackedTransformer` block, e.g. a dense layer followed by a sparse one) the
    unit holds that many layers and is repeated `num_layers / unit layers` times;
    otherwise it is one layer repeated `num_layers` times. Parameters are the unit's
    tree with a leading `[repeats]` axis (logical axis "layers"), so compile time does
    not grow with depth. The unit's output collection comes back stacked on that axis.
    """

    class Config(BaseLayer.Config):
        """Configures RepeatedTransformer."""

        # Model dimension.
        input_dim: Annotated[int, Width] = REQUIRED
        # Total number of layers (a multiple of the unit's layer count).
        num_layers: Annotated[int, Depth] = REQUIRED
        # The repeated unit: a layer, or a stacked_transformer block of several layers.
        layer: InstantiableConfig = TransformerLayer.default_config()
        # Backward-pass rematerialization: None saves every activation; otherwise a
        # jax.checkpoint_policies name, e.g. "nothing_saveable" or "dots_saveable".
        remat_policy: str | None = None
        # Units per scan iteration (lax.scan's unroll): 1 keeps compile time flat in
        # depth; larger trades compile time for less loop overhead per step (>= the units:
        # a pipeline's loop over its schedule's steps is unrolled too).
        unroll: Annotated[int, Depth] = 1
        # Pipeline schedule over the mesh's `stage` axis (e.g. {type: gpipe, microbatches: 4}; see
        # axcore.layers.pipeline); None, or a mesh without a stage axis, = the plain scan.
        pipeline: InstantiableConfig | None = None

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        if cfg.num_layers % self.layers_per_unit:
            raise ConfigError(
                f"{self.path}: num_layers ({cfg.num_layers}) is not a multiple of the repeated "
                f"unit's {self.layers_per_unit} layers."
            )
        if cfg.unroll < 1:
            raise ConfigError(f"{self.path}: unroll must be >= 1, got {cfg.unroll}.")
        self._add_child("layer", with_fields(cfg.layer, input_dim=cfg.input_dim))
        # The pipeline schedule (None: never pipelined).
        self.schedule: PipelineSchedule | None = None if cfg.pipeline is None else cfg.pipeline.instantiate()

    @property
    def layers_per_unit(self) -> int:
        unit = self._config.layer
        return unit.num_layers if "num_layers" in unit.keys() and isinstance(unit.num_layers, int) else 1

    @property
    def repeats(self) -> int:
        return self._config.num_layers // self.layers_per_unit

    def parameter_specs(self) -> dict:
        n = self.repeats

        def stack(spec: ParameterSpec) -> ParameterSpec:
            axes = None if spec.mesh_axes is None else ("layers", *spec.mesh_axes)
            init = StackedInitializer(spec.initializer)
            return dataclasses.replace(spec, shape=(n, *spec.shape), initializer=init, mesh_axes=axes)

        return {"layer": jax.tree.map(stack, self.layer.parameter_specs())}

    def forward(self, x: jax.Array, **kwargs) -> jax.Array:
        """x `[batch, seq, input_dim]` -> the same shape: the unit `repeats` times (a pipeline over the
        mesh's `stage` axis when `pipeline` is set and the traced mesh has more than one stage)."""
        ctx = self._context()
        key = fold_in_name(ctx.prng_key, "layer")
        keys = None if key is None else jax.random.split(key, self.repeats)
        mesh = current_environment().mesh
        if self.schedule is not None and stage_count(mesh) > 1:
            return self._pipelined(x, kwargs, keys, mesh)

        def body(carry, xs):
            layer_params, layer_key = xs
            out, collection = functional(
                self.layer, layer_params, {"x": carry, **kwargs}, layer_key, ctx.is_training
            )
            return out, collection

        if self._config.remat_policy is not None:
            body = jax.checkpoint(body, policy=checkpoint_policy(self._config.remat_policy))
        x, collections = jax.lax.scan(
            body, x, (ctx.state.get("layer", {}), keys), length=self.repeats, unroll=min(self._config.unroll, self.repeats)
        )
        for mine, stacked in zip(ctx.output_collection.child("layer"), collections):
            mine.update(stacked)
        return x

    def _pipelined(self, x: jax.Array, kwargs: dict, keys: jax.Array | None, mesh: Any) -> jax.Array:
        """`forward` as a pipeline (`axcore.layers.pipeline.run_pipeline`) over the mesh's stages."""
        ctx = self._context()
        where = f"{self.path}.pipeline"
        schedule = self.schedule
        table = checked_table(schedule, stage_count(mesh), self.repeats, where)
        m = schedule.microbatches
        arrays = {k: split_microbatches(v, m, where) for k, v in kwargs.items() if v is not None}
        constants = {k: v for k, v in kwargs.items() if v is None}
        key_data = None if keys is None else jax.random.key_data(keys)
        env = current_environment()

        def unit(carry, xs):
            layer_params, layer_key, inputs = xs
            out, collection = functional(self.layer, layer_params, {"x": carry, **inputs}, layer_key, ctx.is_training)
            if jax.tree.leaves(tuple(collection)):
                raise ConfigError(
                    f"{where}: the layers record summaries, auxiliary losses or state updates, which a pipeline "
                    f"does not carry; remove {where} (or the recording feature)."
                )
            return out, None

        if self._config.remat_policy is not None:
            unit = jax.checkpoint(unit, policy=checkpoint_policy(self._config.remat_policy))

        def stage_fn(group, h, inputs, microbatch):
            layer_params, group_keys = group
            if group_keys is not None:  # Dropout differs per microbatch.
                group_keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.wrap_key_data(k), microbatch))(group_keys)
            inputs = {**inputs, **constants}
            # Inside the stage's shard_map the activations' constraints name the mesh without its manual axis.
            with op_environment(jax.sharding.get_abstract_mesh(), env.axis_rules):
                h, _ = jax.lax.scan(
                    lambda c, xs: unit(c, (*xs, inputs)), h, (layer_params, group_keys), unroll=self._config.unroll
                )
            return h

        out = run_pipeline(
            stage_fn, (ctx.state.get("layer", {}), key_data), split_microbatches(x, m, where), arrays, table,
            mesh=mesh, repeats=schedule.repeats, unroll=self._config.unroll >= self.repeats,
        )
        return merge_microbatches(out)

    @no_context
    def init_cache(self, batch: int, max_len: int) -> dict:
        """`{"layer": the unit's empty KV cache}` with a leading `[repeats]` axis on every leaf."""
        unit = self.layer.init_cache(batch, max_len)
        return {"layer": jax.tree.map(lambda a: jnp.broadcast_to(a, (self.repeats, *a.shape)), unit)}

    def extend(self, x: jax.Array, cache: dict, *, positions: jax.Array) -> tuple[jax.Array, dict]:
        """The unit's `extend` under `lax.scan` over (parameters, cache): x `[b, t, dim]` -> `(same shape, cache)`."""
        ctx = self._context()

        def body(carry, xs):
            layer_params, layer_cache = xs
            (out, new_cache), _ = functional(
                self.layer, layer_params, {"x": carry, "cache": layer_cache, "positions": positions}, None,
                ctx.is_training, method="extend",
            )
            return out, new_cache

        x, new = jax.lax.scan(body, x, (ctx.state.get("layer", {}), cache["layer"]), length=self.repeats)
        return x, {"layer": new}

    @no_context
    def init_paged_cache(self, num_blocks: int, block_size: int) -> dict:
        """`{"layer": the unit's empty paged KV cache}` with a leading `[repeats]` axis on every leaf."""
        unit = self.layer.init_paged_cache(num_blocks, block_size)
        return {"layer": jax.tree.map(lambda a: jnp.zeros((self.repeats, *a.shape), a.dtype), unit)}

    def extend_paged(self, x: jax.Array, cache: dict, **paged: jax.Array) -> tuple[jax.Array, dict]:
        """The unit's `extend_paged` under `lax.scan` over the parameters (`paged`: positions, num_new,
        block_tables): x `[b, t, dim]` -> `(same shape, cache)`. The whole stacked cache is the loop's carry,
        each repeat reading and writing its own blocks (`layer_index`), so it is updated in place."""
        if paged.get("layer_index") is not None:
            raise ConfigError(f"{self.path}: a scanned stack inside a scanned stack cannot decode on a paged cache.")
        ctx = self._context()

        def body(carry, xs):
            h, stacked = carry
            layer_params, index = xs
            inputs = {"x": h, "cache": stacked, **paged, "layer_index": index}
            (out, stacked), _ = functional(self.layer, layer_params, inputs, None, ctx.is_training, method="extend_paged")
            return (out, stacked), None

        layers = (ctx.state.get("layer", {}), jnp.arange(self.repeats))
        (x, new), _ = jax.lax.scan(body, (x, cache["layer"]), layers, length=self.repeats)
        return x, {"layer": new}
