"""Causal language model: embedding, decoder stack, final norm, head, and loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated

import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, Depth, InstantiableConfig, Length, NonNegative, Positive, Width
from axcore.config.traversal import find
from axcore.errors import ConfigError
from axcore.kernels.attention import zigzag_permutation
from axcore.kernels.attention_context import CONTEXT_AXIS, zigzag_layout
from axcore.kernels.registry import current_environment
from axcore.layers.attention import MultiheadAttention
from axcore.layers.base import BaseLayer, with_fields
from axcore.layers.basic import Embedding, Linear, RMSNorm
from axcore.layers.position import LearnedPositionEmbedding
from axcore.layers.transformer import RESIDUAL_AXES, StackedTransformer
from axcore.module import no_context
from axcore.platform.sharding import activation_spec

AUX_LOSS = "aux_loss"
# The batch fields `CausalLM.forward` reads (the names of `axcore.data.schema.BATCH_SCHEMA`, plus `kv_mask`).
ACCEPTED_BATCH_FIELDS = frozenset({"input_ids", "target_labels", "target_weights", "positions", "segment_ids", "kv_mask"})
# Logical axes of the logits `[batch, seq, vocab]` (their sharding constraint).
LOGITS_AXES = ("batch", "seq", "vocab")


def cross_entropy(logits, labels, weights, z_loss_scale: Annotated[float, NonNegative] = 0.0) -> tuple[jax.Array, dict]:
    """Weighted mean token cross-entropy plus optional z-loss.

    Args:
        logits: `[..., vocab]` (computed in float32).
        labels: `[...]` int target ids.
        weights: `[...]` float per-token weights (0 for padding).
        z_loss_scale: weight of mean(logsumexp(logits)^2).

    Returns:
        `(loss, metrics)` with metrics cross_entropy, z_loss and num_tokens.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    num = jnp.maximum(jnp.sum(weights), jnp.finfo(jnp.float32).tiny)  # All-zero weights give 0, not NaN.
    xent = jnp.sum((log_z - label_logits) * weights) / num
    z_loss = jnp.sum(jnp.square(log_z) * weights) / num
    loss = xent + z_loss_scale * z_loss
    return loss, {"cross_entropy": xent, "z_loss": z_loss, "num_tokens": jnp.sum(weights)}


def chunked_head_loss(
    project: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    labels: jax.Array,
    weights: jax.Array,
    chunk_len: int,
    z_loss_scale: float = 0.0,
) -> tuple[jax.Array, dict]:
    """`cross_entropy(project(x), labels, weights, z_loss_scale)` without the `[batch, seq, vocab]` logits.

    The positions are split into `ceil(seq / chunk_len)` chunks (padded with weight-0
    positions); a `lax.scan` runs `project` (the head: `[b, c, dim]` -> float32
    `[b, c, vocab]`), the logsumexp and the label pick on one chunk at a time and adds up
    the weighted sums, under `jax.checkpoint` so the backward pass recomputes each
    chunk's logits instead of saving them: memory O(batch x chunk_len x vocab). Chunk j
    holds positions j, j + n, j + 2n, ... (n chunks), so under a sequence-sharded mesh
    every chunk spreads over the devices as the sequence does (when `chunk_len` is a
    multiple of the sequence shards).

    `project` runs inside the scan, so it must record nothing in the output collection
    (no summaries, no kernel-state updates): a stateful `dot` kernel on the head (e.g. a
    delayed-scaling fp8 one) is not supported with chunks.

    Args:
        project: the head, called on `[b, chunk_len, dim]` slices of `x`.
        x: `[b, seq, dim]` the head's input (after the final norm).
        labels: `[b, seq]` int target ids (>= 0).
        weights: `[b, seq]` float per-token weights.
        chunk_len: positions of each row per chunk (at most `seq`).
        z_loss_scale: weight of the z-loss, as in `cross_entropy`.

    Returns:
        `(loss, metrics)` as `cross_entropy`.
    """
    batch, seq = labels.shape
    chunk_len = min(chunk_len, seq)  # A row shorter than a chunk is one chunk, not padded up to chunk_len.
    count = -(-seq // chunk_len)
    pad = count * chunk_len - seq
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        labels, weights = (jnp.pad(a, ((0, 0), (0, pad))) for a in (labels, weights))

    def chunks(a: jax.Array) -> jax.Array:  # [b, count * chunk_len, ...] -> [count, b, chunk_len, ...]
        return jnp.moveaxis(a.reshape(batch, chunk_len, count, *a.shape[2:]), 2, 0)

    def body(sums, xs):
        x_chunk, label_chunk, weight_chunk = xs
        logits = project(x_chunk).astype(jnp.float32)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        label_logits = jnp.take_along_axis(logits, label_chunk[..., None], axis=-1)[..., 0]
        xent_sum = jnp.sum((log_z - label_logits) * weight_chunk)
        return (sums[0] + xent_sum, sums[1] + jnp.sum(jnp.square(log_z) * weight_chunk)), None

    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    zero = jnp.zeros((), jnp.float32)
    (xent_sum, z_sum), _ = jax.lax.scan(body, (zero, zero), (chunks(x), chunks(labels), chunks(weights)))
    total = jnp.sum(weights)
    num = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)  # All-zero weights give 0, not NaN.
    xent, z_loss = xent_sum / num, z_sum / num
    return xent + z_loss_scale * z_loss, {"cross_entropy": xent, "z_loss": z_loss, "num_tokens": total}


def sum_aux_losses(module_outputs: dict) -> jax.Array:
    """Sum of every `aux_loss` leaf in a module-output tree (stacked ones summed too)."""
    total = jnp.zeros((), jnp.float32)
    for key, value in module_outputs.items():
        if isinstance(value, dict):
            total = total + sum_aux_losses(value)
        elif key == AUX_LOSS:
            total = total + jnp.sum(value).astype(jnp.float32)
    return total


class CausalLM(BaseLayer):
    """Decoder-only LM. Token ids `[batch, seq]` -> logits `[batch, seq, vocab_size]`."""

    class Config(BaseLayer.Config):
        """Configures CausalLM."""

        # Vocabulary size.
        vocab_size: Annotated[int, Length] = REQUIRED
        # Model dimension.
        dim: Annotated[int, Width] = REQUIRED
        # Number of decoder layers.
        num_layers: Annotated[int, Depth] = REQUIRED
        # Token embedding.
        embedding: InstantiableConfig = Embedding.default_config()
        # Input position embedding slot (None: positions only inside attention).
        position_embedding: InstantiableConfig | None = LearnedPositionEmbedding.default_config().set(max_len=2048)
        # Decoder stack (stacked_transformer or repeated_transformer).
        decoder: InstantiableConfig = StackedTransformer.default_config()
        # Norm after the decoder.
        final_norm: InstantiableConfig = RMSNorm.default_config()
        # Output projection; None ties it to the token embedding.
        lm_head: InstantiableConfig | None = Linear.default_config().set(bias=False)
        # Weight of the z-loss mean(logsumexp(logits)^2).
        z_loss_scale: Annotated[float, NonNegative] = 0.0
        # Multiply the token embeddings by sqrt(dim) (in the compute dtype) before the decoder.
        scale_embeddings: bool = False
        # Final logit soft-cap c: logits = c * tanh(logits / c), in float32; None = none.
        logits_softcap: Annotated[float, Positive] | None = None
        # In training, when the sequence is split over the `context` mesh axis, reorder each batch into the
        # zigzag order (causal load balancing; docs/context_parallelism.md); no effect without that axis.
        context_load_balance: bool = True
        # `forward` computes the head and cross-entropy this many positions of each row at a time
        # (`chunked_head_loss`), never the whole [batch, seq, vocab] float32 logits; None = all at once.
        loss_chunk_len: Annotated[int, Length] | None = None

    @classmethod
    def default_config(cls):
        cfg = super().default_config()
        for _, attention in find(cfg, MultiheadAttention):
            attention.causal = True
        return cfg

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        for path, attention in find(cfg.decoder, MultiheadAttention):
            if not attention.causal:
                raise ConfigError(
                    f"{self.path}.decoder.{path}: a causal LM needs causal attention, but causal is "
                    f"false (a decoder whose type was switched starts from defaults); set causal: true."
                )
        embedding = with_fields(cfg.embedding, num_embeddings=cfg.vocab_size, dim=cfg.dim, tied_head=cfg.lm_head is None)
        self._add_child("embedding", embedding)
        if cfg.position_embedding is not None:
            self._add_child("position_embedding", with_fields(cfg.position_embedding, dim=cfg.dim))
        self._add_child("decoder", with_fields(cfg.decoder, input_dim=cfg.dim, num_layers=cfg.num_layers))
        self._add_child("final_norm", with_fields(cfg.final_norm, input_dim=cfg.dim))
        if cfg.lm_head is not None:
            lm_head = with_fields(cfg.lm_head, input_dim=cfg.dim, output_dim=cfg.vocab_size, output_dtype="float32")
            self._add_child("lm_head", lm_head.set(weight_axes=("embed", "vocab"), input_axes=("batch", "seq", "embed")))

    def logits(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        kv_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """input_ids `[batch, seq]` -> float32 logits `[batch, seq, vocab_size]`.

        Args:
            input_ids: `[batch, seq]` int token ids.
            positions: `[batch, seq]` int position of each token within its document (the
                input position embedding and every attention layer's, e.g. RoPE, read
                them); default `arange(seq)` in every row.
            kv_mask: `[batch, seq]` bool, False for keys no query may attend; default all valid.
            segment_ids: `[batch, seq]` int document number of each token in a packed row
                (`axcore.data.schema`: from 1, 0 = padding); a token attends only to tokens
                of its own segment, in every attention layer. Default: one segment per row.

        The embedded input (`RESIDUAL_AXES`) and the logits (`LOGITS_AXES`) carry sharding
        constraints under a mesh.
        """
        return self._head(self._hidden(input_ids, positions, kv_mask, segment_ids))

    def _hidden(self, input_ids, positions, kv_mask, segment_ids) -> jax.Array:
        """The decoder's output `[batch, seq, dim]` (before the final norm); arguments as `logits`."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        layer_inputs = {"positions": positions, "kv_mask": kv_mask}
        if segment_ids is not None:  # Left out otherwise, so a decoder without segment support still runs.
            layer_inputs["segment_ids"] = segment_ids
        return self.decoder(self._embed(input_ids, positions), **layer_inputs)

    @no_context
    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty KV cache for `batch` sequences of up to `max_len` tokens: `{"decoder": ...}`,
        nested like the decoder's parameters (see `axcore.layers.transformer`)."""
        limit = self.max_cache_len()
        if limit is not None and max_len > limit:
            raise ValueError(
                f"{self.path}: a KV cache of {max_len} tokens exceeds the learned position embedding's "
                f"max_len {limit}; generate fewer tokens or use a shorter prompt."
            )
        return {"decoder": self.decoder.init_cache(batch, max_len)}

    @no_context
    def max_cache_len(self) -> int | None:
        """Most positions a sequence may have: the input position embedding's `max_len`, None if unlimited."""
        if "position_embedding" in self.children:
            return getattr(self.position_embedding.config, "max_len", None)
        return None

    def extend(self, input_ids: jax.Array, cache: dict, positions: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Logits of new tokens given the KV cache of the earlier ones; the cache comes back with theirs added.

        Prefill: input_ids `[batch, t]` with `t > 1` are every sequence's first `t` tokens
        (positions `0 .. t-1`, the default). Step: input_ids `[batch, 1]`, one token per
        sequence at `positions` `[batch, 1]` (each sequence its own position). Either
        way the logits equal those of `logits()` over the whole sequence so far.

        Returns:
            `(float32 logits [batch, t, vocab_size], cache)`.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        x, decoder_cache = self.decoder.extend(self._embed(input_ids, positions), cache["decoder"], positions=positions)
        return self._head(x), {"decoder": decoder_cache}

    @no_context
    def init_paged_cache(self, num_blocks: int, block_size: int) -> dict:
        """An empty paged KV cache (`axcore.kernels.paged_attention`): `{"decoder": ...}`, nested like the
        decoder's parameters, each attention's `key`/`value` `[num_blocks, block_size, kv_heads, head_dim]`.

        Block 0 is the null block; a sequence may hold at most `max_cache_len()` positions."""
        return {"decoder": self.decoder.init_paged_cache(num_blocks, block_size)}

    def extend_paged(
        self,
        input_ids: jax.Array,
        cache: dict,
        *,
        positions: jax.Array,
        num_new: jax.Array,
        block_tables: jax.Array,
        all_logits: bool = False,
        logit_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        """One inference-engine step over a paged KV cache: each row feeds a chunk of one sequence.

        Row b's first `num_new[b]` tokens are the sequence's next tokens (a prompt chunk, or
        one token in decoding); each attends to every cached token of its sequence at
        positions up to its own (its own key and value written in this call). The logits
        equal those of `logits()` over the whole sequence at the same positions.

        Args:
            input_ids: `[batch, t]` int, left-aligned, padded (with any id).
            cache: `init_paged_cache`'s tree.
            positions: `[batch, t]` int absolute positions of the tokens.
            num_new: `[batch]` int valid tokens per row (0: an empty padding row).
            block_tables: `[batch, max_blocks]` int block ids of each row's sequence, padded with 0.
            all_logits: return every token's logits instead of the last valid one's.
            logit_rows: `[s]` int rows whose last valid token's logits are returned (the head runs on
                those s rows only; rows may repeat); None = every row. Ignored with `all_logits`.
                Several rows of one sequence (one token each, consecutive positions) form a ragged
                step: only the row of its last token needs logits.

        Returns:
            `(logits, cache)`: float32 logits `[batch, vocab_size]` of each row's last valid token
            (token `max(num_new[b] - 1, 0)`; `[s, vocab_size]`, row i the logits of row
            `logit_rows[i]`, with `logit_rows`), or `[batch, t, vocab_size]` with `all_logits`;
            padding tokens' and empty rows' logits are finite garbage.
        """
        paged = {"positions": positions, "num_new": num_new, "block_tables": block_tables}
        x, decoder_cache = self.decoder.extend_paged(self._embed(input_ids, positions), cache["decoder"], **paged)
        if all_logits:
            return self._head(x), {"decoder": decoder_cache}
        if logit_rows is not None:
            x, num_new = x[logit_rows], num_new[logit_rows]
        last = jnp.maximum(num_new - 1, 0)[:, None, None]
        return self._head(jnp.take_along_axis(x, last, axis=1))[:, 0], {"decoder": decoder_cache}

    def _embed(self, input_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """input_ids `[b, t]` -> the decoder's input `[b, t, dim]` (token embeddings, times sqrt(dim) with
        `scale_embeddings`, and input position embeddings)."""
        x = self.embedding(input_ids)
        if self._config.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(self._config.dim), x.dtype)
        if "position_embedding" in self.children:
            x = self.position_embedding.embed_inputs(x, positions)
        return self._constrain(x, RESIDUAL_AXES)

    def _head(self, x: jax.Array) -> jax.Array:
        """The decoder's output `[b, t, dim]` -> float32 logits `[b, t, vocab_size]` (final norm, head,
        `logits_softcap`)."""
        return self._project(self.final_norm(x))

    def _project(self, x: jax.Array) -> jax.Array:
        """The final norm's output `[b, t, dim]` -> float32 logits `[b, t, vocab_size]` (head, `logits_softcap`)."""
        logits = self.lm_head(x) if "lm_head" in self.children else self.embedding.attend(x)
        cap = self._config.logits_softcap
        if cap is not None:
            logits = cap * jnp.tanh(logits.astype(jnp.float32) / cap)
        return self._constrain(logits, LOGITS_AXES)

    @no_context
    def context_shards(self, shape: tuple[int, int]) -> int:
        """How many ways the traced mesh's `context` axis splits a `[batch, seq]` batch's sequence (1: not split)."""
        env = current_environment()
        if env.mesh is None:
            return 1
        spec = activation_spec(RESIDUAL_AXES, (*shape, self._config.dim), env.axis_rules, env.mesh)
        seq = spec[1] if len(spec) > 1 else None
        return int(env.mesh.shape[CONTEXT_AXIS]) if seq == CONTEXT_AXIS else 1

    def zigzag_batch(self, input_batch: dict, shards: int) -> dict:
        """Every `[batch, seq]` field in the zigzag order for `shards` context shards (`zigzag_permutation`),
        `positions` (default `arange(seq)`) included, so position embeddings see the real positions and
        the token-weighted loss is unchanged (labels and weights move with their tokens)."""
        length = input_batch["input_ids"].shape[1]
        if length % (2 * shards):
            raise ConfigError(
                f"{self.path}: a sequence of {length} tokens split over the '{CONTEXT_AXIS}' mesh axis ({shards}) "
                f"with load balancing needs a multiple of 2 * {shards}; change input.seq_len, or set "
                f"model.context_load_balance: false."
            )
        batch = dict(input_batch)
        batch.setdefault("positions", jnp.broadcast_to(jnp.arange(length), input_batch["input_ids"].shape))
        perm = zigzag_permutation(length, shards)
        return {name: jnp.take(value, perm, axis=1) for name, value in batch.items()}

    @no_context
    def accepted_batch_fields(self) -> frozenset[str]:
        """Names of the batch fields `forward` reads: every `axcore.data.schema.BATCH_SCHEMA`
        field plus `kv_mask`. The trainer checks the input pipeline's schema against it
        (`BATCH_SCHEMA.check_accepted`), so a field this model would ignore is an error."""
        return ACCEPTED_BATCH_FIELDS

    def forward(self, input_batch: dict) -> tuple[jax.Array, dict]:
        """Training loss of a batch of (possibly packed) rows.

        Args:
            input_batch: the fields of `axcore.data.schema.BATCH_SCHEMA`, each `[batch, seq]`:
                `input_ids` and `target_labels` int (required; labels < 0 are ignored);
                optional `target_weights` float (default: labels >= 0), `positions` int
                (per-document positions, restarting at 0 with each document; default
                `arange(seq)`), `segment_ids` int (document number within the row from 1,
                0 = padding; no token attends across segments; default one segment), and
                `kv_mask` bool (False for padding keys). Other keys are an error.

        Returns:
            `(loss, metrics)`: loss = cross-entropy + z_loss_scale * z-loss + the sum of
            every `aux_loss` that descendants recorded with `add_module_output`. The
            cross-entropy is the `target_weights`-weighted mean over tokens, and
            `metrics["num_tokens"]` their weight sum, so `loss * num_tokens` (without
            z-loss and aux losses) sums over tokens however the documents are packed.
        """
        unknown = sorted(set(input_batch) - self.accepted_batch_fields())
        if unknown:
            raise ValueError(
                f"{self.path}: the input batch has fields {unknown} that {type(self).__name__}.forward does not "
                f"read (it reads {sorted(self.accepted_batch_fields())}); drop them or use a model that takes them."
            )
        shards = self.context_shards(input_batch["input_ids"].shape) if self._config.context_load_balance else 1
        if shards > 1:
            input_batch = self.zigzag_batch(input_batch, shards)
        labels = input_batch["target_labels"]
        weights = input_batch.get("target_weights")
        if weights is None:
            weights = (labels >= 0).astype(jnp.float32)
        cfg = self._config
        inputs = (
            input_batch["input_ids"],
            input_batch.get("positions"),
            input_batch.get("kv_mask"),
            input_batch.get("segment_ids"),
        )
        with zigzag_layout(shards):
            if cfg.loss_chunk_len is None:
                loss, metrics = cross_entropy(self.logits(*inputs), jnp.maximum(labels, 0), weights, cfg.z_loss_scale)
            else:
                x = self.final_norm(self._hidden(*inputs))
                loss, metrics = chunked_head_loss(
                    self._project, x, jnp.maximum(labels, 0), weights, cfg.loss_chunk_len, cfg.z_loss_scale
                )
        aux = sum_aux_losses(self.output_collection.module_outputs)
        metrics["aux_loss"] = aux
        return loss + aux, metrics
