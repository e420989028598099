"""Run by test_tpu_attention.py with 4 CPU devices: the TPU kernels' shard_map path against the reference.

Each kernel runs in interpret mode on inputs placed with the shardings its problem's
input_specs state (batch over `data`, heads over `model`, segment ids and a key mask),
under a 2x2 ("data", "model") mesh; the reference runs unsharded. Prints one JSON line:
kernel -> largest error, relative to the largest reference value, over the output and
the gradients of q, k and v.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axcore.kernels import AttentionProblem, XlaAttention

from axcore_tpu.flash_attention import PallasTpuAttention
from axcore_tpu.splash_attention import SplashAttention

P = PartitionSpec


def run(kernel, problem, arrays, rows, cotangent):
    def loss(q, k, v, segments, keep):
        out = kernel(problem, q, k, v, q_segment_ids=segments, kv_segment_ids=segments, kv_mask=keep)
        return jnp.sum(out * cotangent), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                   compiler_options={"xla_backend_optimization_level": 0})
    (_, out), grads = step(*arrays, *rows)
    return [np.asarray(x) for x in (out, *grads)]


def main():
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    batch, seq, heads, kv_heads, head_dim = 4, 128, 4, 2, 32
    q = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    segments = jnp.asarray(np.repeat(np.asarray([[0] * 60 + [1] * 68]), batch, 0), jnp.int32)
    keep = jnp.arange(seq)[None, :] < jnp.asarray([128, 100, 128, 90])[:, None]
    spec = P("data", None, "model")
    problem = AttentionProblem.of(
        q, k, platform="cpu", causal=True, has_segment_ids=True, has_kv_mask=True, mesh=mesh,
        input_specs=(spec, spec, spec),
    )
    expected = run(XlaAttention(), problem, (q, k, v), (segments, keep), cotangent)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    rows = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (segments, keep)]
    errors = {}
    for kernel in (SplashAttention(interpret=True, block_q=128, block_kv=128), PallasTpuAttention(interpret=True)):
        assert kernel.is_supported(problem), kernel.is_supported(problem).reason
        actual = run(kernel, problem, placed, rows, jax.device_put(cotangent, NamedSharding(mesh, spec)))
        errors[kernel.name] = max(
            float(np.abs(a - e).max() / max(1.0, np.abs(e).max())) for a, e in zip(actual, expected)
        )
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
