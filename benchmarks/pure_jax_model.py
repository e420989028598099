"""The pure-JAX contender: the benchmark decoder written directly with `jax.numpy` and optax.

What a competent JAX user writes by hand: a dict of arrays, a Python loop over
layers, rotate-half RoPE with its cos/sin tables computed once per forward, exact
GELU, pre-RMSNorm, an untied head, no learned absolute positions, and
`optax.chain(clip_by_global_norm, adamw(mask=...))` with weight decay masked off
the norm scales (as axcore's learner does through its parameter specs). The step
is `jax.jit` with the parameters and optimizer state donated.

Parameters (D = dim, F = ffn, V = vocab, per layer i):
    embed [V, D], layers[i] = {attn_norm [D], wq/wk/wv [D, D], wo [D, D],
    ffn_norm [D], w_up [D, F], w_down [F, D]}, final_norm [D], head [D, V].
Weights are normal with std 1/sqrt(fan_in) (the embedding's fan is D), like axcore's
default initialization; norm scales are ones.

Run as a script (`python -m benchmarks.pure_jax_model --steps N`) it trains N steps
on random tokens and prints the peak RSS, for the memory benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import resource
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The benchmark decoder's sizes (defaults: the full benchmark model)."""

    vocab: int = 256
    dim: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024
    seq: int = 256
    batch: int = 8

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# The smoke-mode model (CI keeps the benchmarks from rotting; the numbers mean nothing).
SMOKE_SHAPE = ModelShape(dim=32, layers=1, heads=4, ffn=128, seq=32, batch=4)


@dataclasses.dataclass(frozen=True)
class Hyper:
    """AdamW as axcore's default learner, with a constant learning rate."""

    learning_rate: float = 3e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


def init_params(key: jax.Array, shape: ModelShape) -> dict[str, Any]:
    """Normal weights with std 1/sqrt(fan_in); norm scales are ones."""
    d, f, v = shape.dim, shape.ffn, shape.vocab
    keys = iter(jax.random.split(key, 2 + 6 * shape.layers))

    def normal(dims, fan_in):
        return jax.random.normal(next(keys), dims, jnp.float32) / math.sqrt(fan_in)

    layers = [
        {
            "attn_norm": jnp.ones((d,), jnp.float32),
            "wq": normal((d, d), d),
            "wk": normal((d, d), d),
            "wv": normal((d, d), d),
            "wo": normal((d, d), d),
            "ffn_norm": jnp.ones((d,), jnp.float32),
            "w_up": normal((d, f), d),
            "w_down": normal((f, d), f),
        }
        for _ in range(shape.layers)
    ]
    return {
        "embed": normal((v, d), d),
        "layers": layers,
        "final_norm": jnp.ones((d,), jnp.float32),
        "head": normal((d, v), d),
    }


def from_axcore(params: dict[str, Any]) -> dict[str, Any]:
    """axcore's (unrolled, RoPE) CausalLM parameter tree in this module's layout (host copies)."""
    layers = []
    dec = params["decoder"]
    for i in range(len(dec)):
        p = dec[f"layer{i}"]
        attn = p["self_attention"]
        d = attn["wq"].shape[0]
        layers.append(
            {
                "attn_norm": p["attention_norm"]["scale"],
                "wq": attn["wq"].reshape(d, -1),
                "wk": attn["wk"].reshape(d, -1),
                "wv": attn["wv"].reshape(d, -1),
                "wo": attn["wo"].reshape(-1, d),
                "ffn_norm": p["ffn_norm"]["scale"],
                "w_up": p["feed_forward"]["up_proj"]["weight"],
                "w_down": p["feed_forward"]["down_proj"]["weight"],
            }
        )
    tree = {
        "embed": params["embedding"]["weight"],
        "layers": layers,
        "final_norm": params["final_norm"]["scale"],
        "head": params["lm_head"]["weight"],
    }
    # Through the host: plain single-device arrays, independent of axcore's mesh shardings.
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), tree)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[seq, 1, head_dim/2]`: angle m * theta^(-2i/head_dim)."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x `[B, T, H, Dh]`: feature i pairs with i + Dh/2."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, heads: int) -> jax.Array:
    b, t, d = x.shape
    q = (x @ p["wq"]).reshape(b, t, heads, -1)
    k = (x @ p["wk"]).reshape(b, t, heads, -1)
    v = (x @ p["wv"]).reshape(b, t, heads, -1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d)
    return out @ p["wo"]


def forward(params: dict, ids: jax.Array, shape: ModelShape, hyper: Hyper) -> jax.Array:
    """ids `[B, T]` -> logits `[B, T, V]`."""
    x = jnp.take(params["embed"], ids, axis=0)
    cos, sin = rope_tables(ids.shape[1], shape.head_dim, hyper.rope_theta)
    for p in params["layers"]:
        x = x + attention(rms_norm(x, p["attn_norm"], hyper.norm_eps), p, cos, sin, shape.heads)
        h = jax.nn.gelu(rms_norm(x, p["ffn_norm"], hyper.norm_eps) @ p["w_up"], approximate=False)
        x = x + h @ p["w_down"]
    return rms_norm(x, params["final_norm"], hyper.norm_eps) @ params["head"]


def loss_fn(params: dict, batch: dict, shape: ModelShape, hyper: Hyper) -> jax.Array:
    """Mean next-token cross-entropy."""
    logits = forward(params, batch["input_ids"], shape, hyper)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    label_logits = jnp.take_along_axis(logits, batch["target_labels"][..., None], axis=-1)[..., 0]
    return jnp.mean(log_z - label_logits)


def decay_mask(params: dict) -> dict:
    """True for weights, False for norm scales (no weight decay on them, as in axcore)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: not path[-1].key.endswith("norm"), params)


def make_optimizer(params: Any, hyper: Hyper, mask: Any = None) -> optax.GradientTransformation:
    """Clip, then AdamW with weight decay on `mask` (default: `decay_mask(params)`)."""
    return optax.chain(
        optax.clip_by_global_norm(hyper.max_grad_norm),
        optax.adamw(
            hyper.learning_rate,
            b1=hyper.b1,
            b2=hyper.b2,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            mask=decay_mask(params) if mask is None else mask,
        ),
    )


def make_train_step(optimizer: optax.GradientTransformation, shape: ModelShape, hyper: Hyper):
    """(params, opt_state, batch) -> (params, opt_state, loss), jitted with donation."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, shape, hyper)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def num_params(params: Any) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


def main(argv: list[str] | None = None) -> None:
    """Trains `--steps` steps on random tokens; prints the loss and this process's peak RSS."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="the tiny smoke-mode model")
    args = parser.parse_args(argv)
    shape, hyper = (SMOKE_SHAPE if args.smoke else ModelShape()), Hyper()
    params = jax.jit(init_params, static_argnums=1)(jax.random.key(0), shape)
    optimizer = make_optimizer(params, hyper)
    opt_state = jax.jit(optimizer.init)(params)
    step = make_train_step(optimizer, shape, hyper)
    rng = np.random.default_rng(0)
    loss = None
    for _ in range(args.steps):
        tokens = rng.integers(0, shape.vocab, (shape.batch, shape.seq + 1), dtype=np.int32)
        batch = {"input_ids": tokens[:, :-1], "target_labels": tokens[:, 1:]}
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"loss {loss:.4f} peak_rss_kib {kib}")


if __name__ == "__main__":
    main()
