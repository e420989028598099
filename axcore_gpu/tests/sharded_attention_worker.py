"""Run by test_cudnn_attention.py with 4 CPU devices: the kernel's shard_map path against the reference.

The kernel runs with implementation="xla" (cuDNN needs a GPU) on inputs placed with the
shardings its problem's input_specs state, under a 2x2 ("data", "model") mesh; the
reference runs unsharded. Prints one JSON line: case -> largest relative error over the
output and the gradients of q, k and v.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axcore.kernels import AttentionProblem, XlaAttention

from axcore_gpu import CudnnAttention, mesh_layout

P = PartitionSpec
# name -> (q spec, kv spec, with kv_mask); "model" is left unmentioned in "batch".
CASES = {
    "batch": (P("data"), P("data"), False),
    "batch+heads": (P("data", None, "model"), P("data", None, "model"), False),
    "batch over both axes": (P(("data", "model")), P(("data", "model")), False),
    "batch, kv mask": (P("data", None, "model"), P("data", None, "model"), True),
}


def run(kernel, problem, arrays, cotangent):
    def loss(q, k, v, *mask):
        out = kernel(problem, q, k, v, **({"kv_mask": mask[0]} if mask else {}))
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*arrays)
    return [np.asarray(x) for x in (out, *grads)]


def main():
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    batch, seq, heads, kv_heads, head_dim = 4, 8, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    lengths = jnp.asarray([[seq], [seq - 3], [seq - 1], [seq - 4]])  # No row loses every key.
    kv_mask = jnp.arange(seq)[None, :] < lengths
    errors = {}
    for case, (q_spec, kv_spec, with_mask) in CASES.items():
        flags = dict(causal=True, scale=0.3, sliding_window=5, has_kv_mask=with_mask)
        problem = AttentionProblem.of(q, k, platform="gpu", mesh=mesh, input_specs=(q_spec, kv_spec, kv_spec), **flags)
        support, specs = mesh_layout(problem)
        assert support and specs is not None, (case, support)
        shardings = [NamedSharding(mesh, s) for s in (q_spec, kv_spec, kv_spec)]
        arrays = [jax.device_put(a, s) for a, s in zip((q, k, v), shardings)]
        reference_arrays = [q, k, v]
        if with_mask:
            arrays.append(jax.device_put(kv_mask, NamedSharding(mesh, P(q_spec[0]))))
            reference_arrays.append(kv_mask)
        actual = run(CudnnAttention(implementation="xla"), problem, arrays, cotangent)
        reference_problem = AttentionProblem.of(q, k, platform="cpu", **flags)
        expected = run(XlaAttention(), reference_problem, reference_arrays, cotangent)
        errors[case] = max(float(np.abs(a - e).max() / max(1.0, np.abs(e).max())) for a, e in zip(actual, expected))
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
