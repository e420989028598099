"""Multi-head self-attention with grouped-query support, q/k-norm and position-embedding slots.

Public parameter names (stable; checkpoints, plugins and sharding rules may rely on
them), with `d = input_dim`, `n = num_heads`, `k = num_kv_heads`, `h = head_dim`:

- `wq` `[d, n, h]` (logical axes `embed, heads, -`), dot site `q_proj`;
- `wk`, `wv` `[d, k, h]` (`embed, kv_heads, -`), dot sites `k_proj`, `v_proj`;
- `wo` `[n, h, d]` (`heads, -, embed`), dot site `o_proj`;
- with `qkv_bias`: `bq` `[n, h]` (`heads, -`), `bk` and `bv` `[k, h]` (`kv_heads, -`),
  added to the projections; with `output_bias`: `bo` `[d]` (`embed`); zeros at init;
- children, when configured: `q_norm`, `k_norm` (e.g. `q_norm/scale` `[h]`) and
  `position_embedding`.

The forward is a short sequence of named steps; each is a public method a subclass
may override (a feature plugin registers the subclass and puts it in the attention
slot with its config transform), without copying `forward`:

1. `project_qkv(x)` -> q `[b, t, n, h]`, k and v `[b, t, k, h]`;
2. `normalize_qk(q, k)` -> q, k (the `q_norm` / `k_norm` children, if set);
3. `position_embed(q, k, positions)` -> q, k (the `position_embedding` child's
   `transform_qk`, e.g. RoPE), after the q/k norm as in QK-norm models;
4. `attend(q, k, v, ...)` -> `[b, t, n, h]` through the `attention` op
   (`axcore.kernels.attention`; the XLA reference kernel is the fallback);
5. `project_output(o)` -> `[b, t, d]`.

Incremental decoding runs the same steps (`extend`): the keys and values of earlier
tokens come from a KV cache (`init_cache`) instead of being recomputed, so a subclass
that overrides a step decodes with it too. The inference engine's form, `extend_paged`,
keeps them in a paged cache (`init_paged_cache`: fixed-size blocks shared by every
sequence, read through each row's block table by the `paged_attention` op).

A subclass adds a child layer with `self.add_child(name, cfg)` in `__init__`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Annotated, Any

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, InstantiableConfig, Length, Positive, Probability, Width
from axcore.errors import ConfigError
from axcore.kernels.attention import ATTENTION, ZIGZAG_EXTRA, AttentionProblem
from axcore.kernels.attention_context import current_zigzag_shards
from axcore.kernels.paged_attention import PAGED_ATTENTION, PagedAttentionProblem, paged_slots, write_paged
from axcore.kernels.registry import current_environment
from axcore.layers.base import BaseLayer, DotSite, with_fields
from axcore.layers.position import PositionEmbedding
from axcore.module import no_context
from axcore.params import FanAxes, ParameterSpec, fold_in_name

# Logical axes of projected queries and keys/values `[batch, seq, heads, head_dim]`.
QKV_AXES = {"q": ("batch", "seq", "heads", None), "kv": ("batch", "seq", "kv_heads", None)}


class MultiheadAttention(BaseLayer):
    """x `[batch, seq, input_dim]` -> `[batch, seq, input_dim]`; steps and parameters in the module docstring."""

    class Config(BaseLayer.Config):
        """Configures MultiheadAttention."""

        # Model dimension.
        input_dim: Annotated[int, Width] = REQUIRED
        # Number of query heads.
        num_heads: Annotated[int, Width] = REQUIRED
        # Number of key/value heads: None = num_heads (MHA), 1 = multi-query, else grouped.
        num_kv_heads: Annotated[int, Width] | None = None
        # Per-head dimension; None = input_dim // num_heads.
        head_dim: Annotated[int, Width] | None = None
        # Whether query i may only attend to keys j <= i.
        causal: bool = False
        # Query i sees only the keys fewer than this many positions behind it; None = all.
        sliding_window: Annotated[int, Length] | None = None
        # Logit soft-cap c: logits = c * tanh(logits / c); None = none.
        softcap: Annotated[float, Positive] | None = None
        # Dropout rate on the attention probabilities, in training only.
        dropout_rate: Annotated[float, Probability] = 0.0
        # Slot for a position embedding acting on queries/keys (a relative one); None = none.
        position_embedding: InstantiableConfig | None = None
        # Norm of each query head over head_dim (e.g. rms_norm; input_dim set by the layer), before the
        # position embedding; None = none.
        q_norm: InstantiableConfig | None = None
        # Norm of each key head over head_dim, as q_norm; None = none.
        k_norm: InstantiableConfig | None = None
        # Attention kernel to force by name; None = highest-priority kernel that supports the call.
        kernel: str | None = None
        # Softmax scale; None = 1 / sqrt(head_dim).
        scale: Annotated[float, Positive] | None = None
        # Whether the q, k and v projections add a learned bias (bq, bk, bv).
        qkv_bias: bool = False
        # Whether the output projection adds a learned bias (bo).
        output_bias: bool = False

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        if cfg.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.path}: num_heads ({cfg.num_heads}) must be a multiple of "
                f"num_kv_heads ({cfg.num_kv_heads})."
            )
        if cfg.head_dim is None and cfg.input_dim % cfg.num_heads:
            raise ConfigError(
                f"{self.path}: num_heads ({cfg.num_heads}) must divide the model dimension ({cfg.input_dim}), "
                f"or set head_dim explicitly."
            )
        for name in ("q_norm", "k_norm"):
            norm = getattr(cfg, name)
            if norm is not None:
                self.add_child(name, with_fields(norm, input_dim=self.head_dim))
        if cfg.position_embedding is not None:
            self.add_child(
                "position_embedding",
                with_fields(cfg.position_embedding, dim=self.head_dim, num_heads=cfg.num_heads),
            )

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_kv_heads or self._config.num_heads

    @property
    def head_dim(self) -> int:
        return self._config.head_dim or self._config.input_dim // self._config.num_heads

    def _create_parameter_specs(self) -> dict[str, ParameterSpec]:
        """`wq` `[d, n, h]`, `wk` and `wv` `[d, k, h]`, `wo` `[n, h, d]` (public names, module docstring)."""
        cfg = self._config
        d, n, k, h = cfg.input_dim, cfg.num_heads, self.num_kv_heads, self.head_dim
        proj = FanAxes((0,), (1, 2))
        return {
            "wq": self._weight((d, n, h), ("embed", "heads", None), proj),
            "wk": self._weight((d, k, h), ("embed", "kv_heads", None), proj),
            "wv": self._weight((d, k, h), ("embed", "kv_heads", None), proj),
            "wo": self._weight((n, h, d), ("heads", None, "embed"), FanAxes((0, 1), (2,))),
            **(self._bias_specs() if cfg.qkv_bias or cfg.output_bias else {}),
        }

    def _bias_specs(self) -> dict[str, ParameterSpec]:
        """`bq` `[n, h]`, `bk` and `bv` `[k, h]` (with `qkv_bias`) and `bo` `[d]` (with `output_bias`), zeros."""
        cfg = self._config
        n, k, h = cfg.num_heads, self.num_kv_heads, self.head_dim
        specs = {}
        if cfg.qkv_bias:
            specs["bq"] = self._constant((n, h), 0.0, ("heads", None))
            specs["bk"] = self._constant((k, h), 0.0, ("kv_heads", None))
            specs["bv"] = self._constant((k, h), 0.0, ("kv_heads", None))
        if cfg.output_bias:
            specs["bo"] = self._constant((cfg.input_dim,), 0.0, ("embed",))
        return specs

    def _add_bias(self, y: jax.Array, name: str) -> jax.Array:
        """y + the bias parameter `name` (in y's dtype) where this layer has one, else y."""
        bias = self.parameters.get(name)
        return y if bias is None else y + bias.astype(y.dtype)

    def _dot_sites(self) -> dict[str, DotSite]:
        x_axes = ("batch", "seq", "embed")
        return {
            "q_proj": DotSite("wq", x_axes=x_axes),
            "k_proj": DotSite("wk", x_axes=x_axes),
            "v_proj": DotSite("wv", x_axes=x_axes),
            "o_proj": DotSite("wo", (0, 1), x_axes=QKV_AXES["q"]),
        }

    def forward(
        self,
        x: jax.Array,
        *,
        positions: jax.Array | None = None,
        kv_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Self-attention: `project_qkv`, `normalize_qk`, `position_embed`, `attend`, `project_output`.

        Args:
            x: `[batch, seq, input_dim]`.
            positions: `[batch, seq]` int positions; default `arange(seq)`.
            kv_mask: `[batch, seq]` bool, False for padding keys; default all valid.
            segment_ids: `[batch, seq]` int; tokens attend only within their segment
                (packed sequences); default one segment.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        slot = _DECODING.get().get(id(self))
        if slot is not None:  # Inside `decoding_into(self, ...)`: the KV-cache form of this same call.
            if kv_mask is not None or segment_ids is not None:
                raise ValueError(f"{self.path}: KV-cache decoding takes neither kv_mask nor segment_ids.")
            if slot.paged is not None:
                out, slot.cache = self.extend_paged(x, slot.cache, positions=positions, **slot.paged)
            else:
                out, slot.cache = self.extend(x, slot.cache, positions=positions)
            return out
        q, k, v = self.project_qkv(x)
        q, k = self.normalize_qk(q, k)
        q, k = self.position_embed(q, k, positions)
        out = self.attend(q, k, v, positions=positions, kv_mask=kv_mask, segment_ids=segment_ids)
        return self.project_output(out)

    @no_context
    def init_cache(self, batch: int, max_len: int) -> dict[str, jax.Array]:
        """An empty KV cache: `key` and `value` `[batch, max_len, kv_heads, head_dim]` zeros in the compute dtype.

        Slot `j` holds the (position-embedded) key and value of the token at position `j`.
        """
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return {"key": jnp.zeros(shape, self.compute_dtype), "value": jnp.zeros(shape, self.compute_dtype)}

    def extend(self, x: jax.Array, cache: dict, *, positions: jax.Array) -> tuple[jax.Array, dict]:
        """Self-attention of new tokens against the KV cache; returns `(out, cache)` with the new keys written.

        Two forms, told apart by the number of new tokens `t`:

        - prefill (`t > 1`): the first `t` tokens of every sequence (positions must be
          `0 .. t-1`); they attend causally among themselves, exactly as `forward`, and
          their keys and values fill cache slots `0 .. t-1`;
        - step (`t == 1`): one token per sequence at its own position `p_b`; its key and
          value go to slot `p_b`, and it attends to slots `j <= p_b` (and, with a sliding
          window, `p_b - j < window`). Slots after `p_b` are never read, so a shorter
          prompt's padding left there by the prefill is overwritten before it is seen.

        Args:
            x: `[batch, t, input_dim]`.
            cache: `init_cache`'s tree, `[batch, max_len, kv_heads, head_dim]` each; it
                carries the sharding constraint of the training keys (`QKV_AXES["kv"]`).
            positions: `[batch, t]` int absolute positions (the cache slots written).

        Returns:
            `([batch, t, input_dim], cache)`.
        """
        q, k, v = self.project_qkv(x)
        q, k = self.normalize_qk(q, k)
        q, k = self.position_embed(q, k, positions)
        t, max_len = x.shape[1], cache["key"].shape[1]
        if t > max_len:
            raise ValueError(f"{self.path}: {t} new tokens do not fit a KV cache of {max_len} slots.")
        if t > 1:  # Prefill: slots 0 .. t-1.
            def write(slots, update):
                return jax.lax.dynamic_update_slice_in_dim(slots, update.astype(slots.dtype), 0, axis=1)
        else:  # Step: one row per sequence, a scatter (in place inside a decode loop).
            slot, rows = positions[:, 0], jnp.arange(x.shape[0])

            def write(slots, update):
                return slots.at[rows, slot].set(update[:, 0].astype(slots.dtype))

        new = {
            name: self._constrain(write(cache[name], update), QKV_AXES["kv"])
            for name, update in (("key", k), ("value", v))
        }
        if t > 1:
            out = self.attend(q, k, v, positions=positions)
        else:
            slots = jnp.arange(max_len)[None, :]
            visible = slots <= slot[:, None]
            window = self._config.sliding_window
            if window is not None:
                visible = visible & (slot[:, None] - slots < window)
            kv_positions = jnp.broadcast_to(slots, (x.shape[0], max_len))
            out = self.attend(
                q, new["key"], new["value"],
                positions=positions, kv_mask=visible, kv_positions=kv_positions, masked_by_positions=True,
            )
        return self.project_output(out), new

    @no_context
    def init_paged_cache(self, num_blocks: int, block_size: int) -> dict[str, jax.Array]:
        """An empty paged KV cache: `key` and `value` `[num_blocks, block_size, kv_heads, head_dim]` zeros in
        the compute dtype (block 0 is the null block, see `axcore.kernels.paged_attention`)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return {"key": jnp.zeros(shape, self.compute_dtype), "value": jnp.zeros(shape, self.compute_dtype)}

    def extend_paged(
        self,
        x: jax.Array,
        cache: dict,
        *,
        positions: jax.Array,
        num_new: jax.Array,
        block_tables: jax.Array,
        layer_index: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        """`extend` over a paged cache: each row's new tokens write their keys and values into their
        sequence's blocks, then attend to everything of their sequence at positions up to their own.

        Runs the same named steps (`project_qkv`, `normalize_qk`, `position_embed`) as `forward`,
        then `attend_paged` and `project_output`.

        Args:
            x: `[batch, t, input_dim]`; row b's first `num_new[b]` tokens are valid (the rest padding).
            cache: `init_paged_cache`'s tree, `[num_blocks, block_size, kv_heads, head_dim]` each.
            positions: `[batch, t]` int absolute positions of the new tokens.
            num_new: `[batch]` int valid tokens per row (0: an empty row).
            block_tables: `[batch, max_blocks]` int block ids of each row's sequence (padded with 0);
                position p lives in block `block_tables[b, p // block_size]` at offset `p % block_size`.
                Padding tokens write into the null block 0.
            layer_index: in a scanned stack (`RepeatedTransformer`), the cache's leaves are the whole
                stack's, `[repeats, num_blocks, ...]`, and this traced int picks this layer's: the leaves
                are read as `repeats * num_blocks` blocks and the tables shifted by `layer_index * num_blocks`
                (a reshape, so the stacked cache is updated in place, never sliced out and copied).

        Returns:
            `([batch, t, input_dim], cache)`; outputs of padding tokens are finite garbage.
        """
        q, k, v = self.project_qkv(x)
        q, k = self.normalize_qk(q, k)
        q, k = self.position_embed(q, k, positions)
        stacked = cache["key"].shape
        if layer_index is not None:  # The stack's blocks as one array; this layer's are at layer_index * blocks.
            block_tables = block_tables + layer_index * stacked[1]
            cache = {name: a.reshape(-1, *a.shape[2:]) for name, a in cache.items()}
        slots = paged_slots(positions, num_new, block_tables, cache["key"].shape[1])
        new = {"key": write_paged(cache["key"], slots, k), "value": write_paged(cache["value"], slots, v)}
        out = self.attend_paged(q, new, positions=positions, num_new=num_new, block_tables=block_tables)
        return self.project_output(out), {name: a.reshape(stacked) for name, a in new.items()}

    def attend_paged(
        self, q: jax.Array, cache: dict, *, positions: jax.Array, num_new: jax.Array, block_tables: jax.Array
    ) -> jax.Array:
        """The attention step over a paged cache, through the selected `paged_attention` kernel: q
        `[b, t, heads, head_dim]` and the cache (new keys already written) -> `[b, t, heads, head_dim]`
        (scale, soft-cap, sliding window and position biases per config; no dropout)."""
        cfg = self._config
        slopes, bias_fn = self._position_bias()
        problem = PagedAttentionProblem.of(
            q, cache["key"], block_tables,
            mesh=current_environment().mesh,
            extras=self.op_extras(PAGED_ATTENTION),
            scale=cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(self.head_dim),
            sliding_window=cfg.sliding_window,
            softcap=cfg.softcap,
            bias_slopes=slopes,
            bias_fn=bias_fn,
            site=f"{self.path}.paged_attention",
        )
        kernel = self.registries.kernels.select(PAGED_ATTENTION, problem, requested=self.kernel_choice(PAGED_ATTENTION))
        return self._run_kernel(
            kernel, "paged_attention", problem, q, cache["key"], cache["value"], block_tables, positions, num_new
        )

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Step 1, the input projections (`wq`, `wk`, `wv` through the `dot` op, plus `bq`, `bk`, `bv`
        with `qkv_bias`).

        x `[b, t, input_dim]` -> q `[b, t, heads, head_dim]`, k and v `[b, t, kv_heads, head_dim]`,
        each with a sharding constraint from its logical axes (`QKV_AXES`).
        """
        q = self._constrain(self._add_bias(self._dot("q_proj", x), "bq"), QKV_AXES["q"])
        k = self._constrain(self._add_bias(self._dot("k_proj", x), "bk"), QKV_AXES["kv"])
        return q, k, self._constrain(self._add_bias(self._dot("v_proj", x), "bv"), QKV_AXES["kv"])

    def normalize_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Step 2, the q/k norm: the `q_norm` / `k_norm` children over head_dim (identity where unset).

        q `[b, t, heads, head_dim]`, k `[b, s, kv_heads, head_dim]` -> `(q, k)` of the same shapes.
        Runs before `position_embed`, so a QK-norm sees un-rotated queries and keys.
        """
        if "q_norm" in self.children:
            q = self.q_norm(q)
        if "k_norm" in self.children:
            k = self.k_norm(k)
        return q, k

    def position_embed(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Step 3, the relative position embedding: the `position_embedding` child's `transform_qk`
        (identity where unset; biases such as ALiBi act in `attend` instead).

        q `[b, t, heads, head_dim]`, k `[b, t, kv_heads, head_dim]`, positions `[b, t]` int
        -> `(q, k)` of the same shapes.
        """
        if "position_embedding" in self.children:
            q, k = self.position_embedding.transform_qk(q, k, positions, positions)
        return q, k

    def project_output(self, out: jax.Array) -> jax.Array:
        """Step 5, the output projection (`wo` through the `dot` op, plus `bo` with `output_bias`).

        out `[b, t, heads, head_dim]` (constrained like q) -> `[b, t, input_dim]`.
        """
        return self._add_bias(self._dot("o_proj", self._constrain(out, QKV_AXES["q"])), "bo")

    def _position_bias(self) -> tuple[tuple[float, ...] | None, Any]:
        """`(bias_slopes, bias_fn)` of the position embedding for the attention ops (ALiBi slopes, or an
        overridden `attention_bias`); `(None, None)` without a position bias."""
        slopes, bias_fn = None, None
        if "position_embedding" in self.children:
            embedding = self.position_embedding
            found = embedding.bias_slopes()
            if found is not None:
                slopes = tuple(float(s) for s in found)
            elif type(embedding).attention_bias is not PositionEmbedding.attention_bias:
                bias_fn = embedding.attention_bias
        return slopes, bias_fn

    def attend(
        self, q, k, v, *, positions=None, kv_mask=None, segment_ids=None, kv_positions=None, masked_by_positions=False
    ) -> jax.Array:
        """Step 4, the attention op: runs the selected kernel (see `axcore.kernels.attention`).

        Args:
            q: `[b, t, heads, head_dim]`.
            k, v: `[b, s, kv_heads, head_dim]` (kv heads are shared by groups of query heads).
            positions: `[b, t]` int, for position biases (ALiBi slopes or `attention_bias`).
            kv_mask: `[b, s]` bool, False for padding keys; None = all valid.
            segment_ids: `[b, t]` int (packed sequences); None = one segment.
            kv_positions: `[b, s]` int positions of the keys; None = `positions` (self-attention).
            masked_by_positions: the caller's `kv_mask` already holds the causal and
                sliding-window masks (by position, as in a decode step), so the kernel
                applies neither.

        Returns:
            `[b, t, heads, head_dim]`, softmax-weighted values (masking, soft-cap, dropout per config).
        """
        cfg = self._config
        slopes, bias_fn = self._position_bias()
        dropout = cfg.dropout_rate if self.is_training else 0.0
        extras = self.op_extras(ATTENTION)
        if current_zigzag_shards() > 1:  # The sequence is in zigzag order (CausalLM's context load balancing).
            extras = {**extras, ZIGZAG_EXTRA: current_zigzag_shards()}
        problem = AttentionProblem.of(
            q,
            k,
            mesh=current_environment().mesh,
            input_specs=self._input_specs((QKV_AXES["q"], q), (QKV_AXES["kv"], k), (QKV_AXES["kv"], v)),
            extras=extras,
            scale=cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(self.head_dim),
            causal=cfg.causal and not masked_by_positions,
            sliding_window=None if masked_by_positions else cfg.sliding_window,
            has_segment_ids=segment_ids is not None,
            softcap=cfg.softcap,
            dropout_rate=dropout,
            bias_slopes=slopes,
            bias_fn=bias_fn,
            has_kv_mask=kv_mask is not None,
            site=f"{self.path}.attention",
        )
        kernel = self.registries.kernels.select(ATTENTION, problem, requested=cfg.kernel or self.kernel_choice(ATTENTION))
        inputs = {}
        if kv_mask is not None:
            inputs["kv_mask"] = kv_mask
        if segment_ids is not None:
            inputs["q_segment_ids"] = inputs["kv_segment_ids"] = segment_ids
        if slopes is not None or bias_fn is not None:
            inputs["q_positions"] = positions
            inputs["kv_positions"] = positions if kv_positions is None else kv_positions
        if dropout > 0.0:
            if self.prng_key is None:
                raise ValueError(f"{self.path}: attention dropout in training needs a prng_key.")
            inputs["dropout_key"] = fold_in_name(self.prng_key, "attention_dropout")
        return self._run_kernel(kernel, "attention", problem, q, k, v, **inputs)



class CacheSlot:
    """The KV cache one attention reads and writes while a layer's `forward` runs as decoding."""

    def __init__(self, cache: dict, paged: dict | None = None):
        # `init_cache`'s (or `init_paged_cache`'s) tree; replaced by the updated cache when the attention runs.
        self.cache = cache
        # `extend_paged`'s `num_new` and `block_tables` when the cache is paged; None for a dense cache.
        self.paged = paged


# id(attention) -> its CacheSlot, for the attentions decoding in this context. Never mutated: `decoding_into`
# sets a new dict, so the shared empty default is safe.
_DECODING: contextvars.ContextVar[dict[int, CacheSlot]] = contextvars.ContextVar("axcore_decoding", default={})  # noqa: B039


@contextlib.contextmanager
def decoding_into(attention: MultiheadAttention, cache: dict, paged: dict | None = None) -> Iterator[CacheSlot]:
    """While active, `attention`'s forward runs as `attention.extend` against `cache`
    (the slot's `cache` holds the updated one afterwards); with `paged` (`{"num_new": ...,
    "block_tables": ...}`) as `attention.extend_paged` against a paged cache.

    This is how a layer decodes through its own named steps: `TransformerLayer.extend` runs
    the layer's `forward` (so `attention_block` / `ffn_block`, or a subclass's override of
    them or of `forward`, run in decoding exactly as in training) with its attention
    redirected to the cache.
    """
    slot = CacheSlot(cache, paged)
    token = _DECODING.set({**_DECODING.get(), id(attention): slot})
    try:
        yield slot
    finally:
        _DECODING.reset(token)
