"""The Flax NNX contender: the benchmark decoder as `nnx.Module`s.

Idiomatic NNX layers (`nnx.Embed`, `nnx.Linear(use_bias=False)`, `nnx.RMSNorm`),
rotate-half RoPE as in `benchmarks.pure_jax_model`, and the fastest documented way
to train it: the functional API (`nnx.split` once, `nnx.merge` inside a `jax.jit`
step with the parameter and optimizer state donated), which avoids `nnx.jit`'s
per-call graph traversal. The optimizer is the same optax chain as the pure-JAX
contender (weight decay masked off the norm scales).

Needs `flax` (the `benchmark` extra: `pip install -e '.[benchmark]'`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks.pure_jax_model import Hyper, ModelShape, apply_rope, make_optimizer, rope_tables


def _normal(fan_in: int):
    return nnx.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


class Attention(nnx.Module):
    def __init__(self, shape: ModelShape, rngs: nnx.Rngs):
        d = shape.dim
        self.heads = shape.heads
        self.wq = nnx.Linear(d, d, use_bias=False, kernel_init=_normal(d), rngs=rngs)
        self.wk = nnx.Linear(d, d, use_bias=False, kernel_init=_normal(d), rngs=rngs)
        self.wv = nnx.Linear(d, d, use_bias=False, kernel_init=_normal(d), rngs=rngs)
        self.wo = nnx.Linear(d, d, use_bias=False, kernel_init=_normal(d), rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q = self.wq(x).reshape(b, t, self.heads, -1)
        k = self.wk(x).reshape(b, t, self.heads, -1)
        v = self.wv(x).reshape(b, t, self.heads, -1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1)
        return self.wo(jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, shape: ModelShape, hyper: Hyper, rngs: nnx.Rngs):
        d, f = shape.dim, shape.ffn
        self.attn_norm = nnx.RMSNorm(d, epsilon=hyper.norm_eps, rngs=rngs)
        self.attn = Attention(shape, rngs)
        self.ffn_norm = nnx.RMSNorm(d, epsilon=hyper.norm_eps, rngs=rngs)
        self.up = nnx.Linear(d, f, use_bias=False, kernel_init=_normal(d), rngs=rngs)
        self.down = nnx.Linear(f, d, use_bias=False, kernel_init=_normal(f), rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.down(jax.nn.gelu(self.up(self.ffn_norm(x)), approximate=False))


class Decoder(nnx.Module):
    """ids `[B, T]` -> logits `[B, T, V]`."""

    def __init__(self, shape: ModelShape, hyper: Hyper, rngs: nnx.Rngs):
        self.shape, self.theta = shape, hyper.rope_theta
        self.embed = nnx.Embed(shape.vocab, shape.dim, embedding_init=_normal(shape.dim), rngs=rngs)
        self.blocks = nnx.List([Block(shape, hyper, rngs) for _ in range(shape.layers)])
        self.final_norm = nnx.RMSNorm(shape.dim, epsilon=hyper.norm_eps, rngs=rngs)
        self.head = nnx.Linear(shape.dim, shape.vocab, use_bias=False, kernel_init=_normal(shape.dim), rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        cos, sin = rope_tables(ids.shape[1], self.shape.head_dim, self.theta)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.final_norm(x))


def load_pure_params(model: Decoder, params: dict[str, Any]) -> None:
    """Sets `model`'s parameters to the pure-JAX contender's tree (same math, same numbers)."""
    model.embed.embedding.value = jnp.array(params["embed"])
    for block, p in zip(model.blocks, params["layers"]):
        block.attn_norm.scale.value = jnp.array(p["attn_norm"])
        for name in ("wq", "wk", "wv", "wo"):
            getattr(block.attn, name).kernel.value = jnp.array(p[name])
        block.ffn_norm.scale.value = jnp.array(p["ffn_norm"])
        block.up.kernel.value = jnp.array(p["w_up"])
        block.down.kernel.value = jnp.array(p["w_down"])
    model.final_norm.scale.value = jnp.array(params["final_norm"])
    model.head.kernel.value = jnp.array(params["head"])


def decay_mask(state: Any) -> Any:
    """False for RMSNorm scales (no weight decay), True for every other parameter."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in ("attn_norm", "ffn_norm", "final_norm") for k in path),
        state,
    )


def functional_step(model: Decoder, hyper: Hyper):
    """-> (graphdef, params, optimizer, step(params, opt_state, batch) -> (params, opt_state, loss)).

    The step is the functional split/merge training loop's, jitted with donation.
    """
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(params, hyper, mask=decay_mask(params))

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["input_ids"])
        log_z = jax.nn.logsumexp(logits, axis=-1)
        label_logits = jnp.take_along_axis(logits, batch["target_labels"][..., None], axis=-1)[..., 0]
        return jnp.mean(log_z - label_logits)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return graphdef, params, optimizer, step
