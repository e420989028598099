"""Causal language model: embedding, decoder stack, final norm, head, and loss."""

from __future__ import annotations

from typing import Annotated
import jax
import jax.numpy as jnp

from axcore.config import REQUIRED, Depth, InstantiableConfig, Length, NonNegative, Width
from axcore.config.traversal import find
from axcore.errors import ConfigError
from axcore.layers.attention import MultiheadAttention
from axcore.layers.base import BaseLayer, with_fields
from axcore.layers.basic import Embedding, Linear, RMSNorm
from axcore.layers.position import LearnedPositionEmbedding
from axcore.layers.transformer import RESIDUAL_AXES, StackedTransformer
from axcore.module import no_context

AUX_LOSS = "aux_loss"
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

    def logits(self, input_ids: jax.Array, positions: jax.Array | None = None, kv_mask=None) -> jax.Array:
        """input_ids `[batch, seq]` -> float32 logits `[batch, seq, vocab_size]`.

        The embedded input (`RESIDUAL_AXES`) and the logits (`LOGITS_AXES`) carry sharding
        constraints under a mesh.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        x = self.decoder(self._embed(input_ids, positions), positions=positions, kv_mask=kv_mask)
        return self._head(x)

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

    def _embed(self, input_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """input_ids `[b, t]` -> the decoder's input `[b, t, dim]` (token and input position embeddings)."""
        x = self.embedding(input_ids)
        if "position_embedding" in self.children:
            x = self.position_embedding.embed_inputs(x, positions)
        return self._constrain(x, RESIDUAL_AXES)

    def _head(self, x: jax.Array) -> jax.Array:
        """The decoder's output `[b, t, dim]` -> float32 logits `[b, t, vocab_size]` (final norm, head)."""
        x = self.final_norm(x)
        logits = self.lm_head(x) if "lm_head" in self.children else self.embedding.attend(x)
        return self._constrain(logits, LOGITS_AXES)

    def forward(self, input_batch: dict) -> tuple[jax.Array, dict]:
        """Training loss.

        Args:
            input_batch: `input_ids` and `target_labels` `[batch, seq]` int; optional
                `target_weights` `[batch, seq]` (default: labels >= 0), `positions`,
                `kv_mask` (False for padding).

        Returns:
            `(loss, metrics)`: loss = cross-entropy + z_loss_scale * z-loss + the sum of
            every `aux_loss` that descendants recorded with `add_module_output`.
        """
        labels = input_batch["target_labels"]
        weights = input_batch.get("target_weights")
        if weights is None:
            weights = (labels >= 0).astype(jnp.float32)
        logits = self.logits(
            input_batch["input_ids"], input_batch.get("positions"), input_batch.get("kv_mask")
        )
        loss, metrics = cross_entropy(logits, jnp.maximum(labels, 0), weights, self._config.z_loss_scale)
        aux = sum_aux_losses(self.output_collection.module_outputs)
        metrics["aux_loss"] = aux
        return loss + aux, metrics
