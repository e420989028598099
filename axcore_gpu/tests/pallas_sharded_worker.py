"""Run by test_pallas_attention.py with 4 CPU devices: the Pallas kernel's shard_map path against the reference.

The kernel runs in interpret mode on inputs placed with the shardings its problem's
input_specs state, under a 2x2 ("data", "model") mesh; the reference runs unsharded.
Prints one JSON line: {"errors": case -> largest relative error over the output and
the gradients of q, k and v, "triton_calls": Triton custom calls in the gradient
lowered for CUDA (interpret=False) under the same mesh, batch and heads sharded; null when
AXCORE_TEST_CUDA_LOWERING=0, which the test sets where a GPU is present}.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axcore.kernels import AttentionProblem, XlaAttention

from axcore_gpu.pallas_attention import PallasAttention

P = PartitionSpec
# name -> (q spec, kv spec, with segment ids and kv_mask)
CASES = {
    "batch": (P("data"), P("data"), False),
    "batch+heads, segments, kv mask": (P("data", None, "model"), P("data", None, "model"), True),
}


def run(kernel, problem, arrays, extra, cotangent):
    def loss(q, k, v, *rest):
        inputs = {}
        if rest:
            inputs = dict(q_segment_ids=rest[0], kv_segment_ids=rest[0], kv_mask=rest[1])
        out = kernel(problem, q, k, v, **inputs)
        return jnp.sum(out * cotangent), out

    # Interpret mode makes compiling the cost: a lower backend optimization level halves it.
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                   compiler_options={"xla_backend_optimization_level": 0})
    (_, out), grads = step(*arrays, *extra)
    return [np.asarray(x) for x in (out, *grads)]


def main():
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    batch, seq, heads, kv_heads, head_dim = 4, 32, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    # Two packed sequences per row; padding only at the end of the last one (every query keeps a key).
    segment_ids = jnp.asarray(np.arange(seq)[None, :] >= np.asarray([[10], [16], [5], [20]]), jnp.int32)
    kv_mask = jnp.arange(seq)[None, :] < jnp.asarray([[seq], [seq - 3], [seq - 1], [seq - 4]])
    kernel = PallasAttention(interpret=True, block_q=16, block_k=16)
    errors = {}
    for case, (q_spec, kv_spec, with_extra) in CASES.items():
        flags = dict(causal=True, scale=0.3, sliding_window=9, softcap=2.0,
                     has_segment_ids=with_extra, has_kv_mask=with_extra)
        problem = AttentionProblem.of(q, k, platform="gpu", mesh=mesh, input_specs=(q_spec, kv_spec, kv_spec), **flags)
        assert kernel.is_supported(problem), (case, kernel.is_supported(problem))
        shardings = [NamedSharding(mesh, s) for s in (q_spec, kv_spec, kv_spec)]
        arrays = [jax.device_put(a, s) for a, s in zip((q, k, v), shardings)]
        extra = []
        if with_extra:
            rows = NamedSharding(mesh, P(q_spec[0]))
            extra = [jax.device_put(segment_ids, rows), jax.device_put(kv_mask, rows)]
        actual = run(kernel, problem, arrays, extra, cotangent)
        reference_problem = AttentionProblem.of(q, k, platform="cpu", **flags)
        expected = run(XlaAttention(), reference_problem, [q, k, v], [segment_ids, kv_mask] if with_extra else [],
                       cotangent)
        errors[case] = max(float(np.abs(a - e).max() / max(1.0, np.abs(e).max())) for a, e in zip(actual, expected))
    cuda_lowering = os.environ.get("AXCORE_TEST_CUDA_LOWERING", "1") == "1"
    print(json.dumps({"errors": errors, "triton_calls": lowered_for_cuda(mesh) if cuda_lowering else None}))


def lowered_for_cuda(mesh):
    """Triton calls in the forward and backward of the GPU kernel lowered for CUDA under the mesh."""
    spec = P("data", None, "model")
    q = jax.ShapeDtypeStruct((4, 256, 8, 64), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    k = jax.ShapeDtypeStruct((4, 256, 2, 64), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    segment_ids = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    problem = AttentionProblem.of(q, k, platform="gpu", mesh=mesh, input_specs=(spec,) * 3, causal=True,
                                  has_segment_ids=True)
    kernel = PallasAttention()
    assert kernel.is_supported(problem)

    def loss(q, k, v, ids):
        return jnp.sum(kernel(problem, q, k, v, q_segment_ids=ids, kv_segment_ids=ids).astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, segment_ids).lower(lowering_platforms=("cuda",))
    return lowered.as_text().count("__gpu$xla.gpu.triton")


if __name__ == "__main__":
    main()
