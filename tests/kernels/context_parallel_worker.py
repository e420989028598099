"""The 8-device checks of tests/kernels/test_context_parallel.py, in one process (one JAX start-up).

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`. Prints one
JSON object on the last line of stdout:

    {"kernels": {case: {"out": err, "dq": err, "dk": err, "dv": err, "selected": name}},
     "runs": {name: {"losses": [...], "reference": name or null, "kernels": {...}}}}

Kernel cases: the `context_ring` and `context_all_gather` kernels on a (data 2, context 4)
mesh vs. a plain-JAX attention written here (a dense softmax over a `[T, T]` mask built
from the original token order, GQA by repeating kv heads), outputs and q/k/v gradients,
float32. With load balancing the inputs are stored in zigzag order (permuted with NumPy
here) and the results permuted back before comparing.
"""

from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

jax.config.update("jax_default_matmul_precision", "highest")

from axcore.kernels import AttentionProblem, op_environment  # noqa: E402
from axcore.kernels.attention_context import AllGatherAttention, RingAttention  # noqa: E402

B, T, H = 2, 32, 8
CONTEXT = 4


def reference(q, k, v, *, causal, window=None, seg=None, softcap=None):
    """Dense attention in natural order: `[b, t, n, h]`, GQA by repeating each kv head."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[3])
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = np.ones((T, T), bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= i - j < window
    allowed = jnp.asarray(allowed)[None, None]
    if seg is not None:
        allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
    logits = jnp.where(allowed, logits, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def zigzag(length, shards):
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def kernel_case(mesh, kernel, *, heads, kv_heads, causal=True, balance=False, segments=False, window=None, softcap=None):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, heads, H)).astype(np.float32)
    k = rng.standard_normal((B, T, kv_heads, H)).astype(np.float32)
    v = rng.standard_normal((B, T, kv_heads, H)).astype(np.float32)
    seg = np.sort(rng.integers(1, 4, (B, T)), axis=1).astype(np.int32) if segments else None
    cot = rng.standard_normal((B, T, heads, H)).astype(np.float32)

    def ref_loss(q, k, v):
        return jnp.sum(reference(q, k, v, causal=causal, window=window, seg=seg, softcap=softcap) * cot)

    want_out = reference(q, k, v, causal=causal, window=window, seg=seg, softcap=softcap)
    want_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)

    perm = zigzag(T, CONTEXT) if balance else np.arange(T)
    qs, ks, vs, cs = (x[:, perm] for x in (q, k, v, cot))
    segs = None if seg is None else seg[:, perm]
    spec_q, spec_kv = P("data", "context", None, None), P("data", "context", None, None)
    problem = AttentionProblem.of(
        qs, ks, mesh=mesh, input_specs=(spec_q, spec_kv, spec_kv), causal=causal, sliding_window=window,
        has_segment_ids=segments, softcap=softcap, extras={"context_zigzag": CONTEXT} if balance else {},
    )
    support = kernel.is_supported(problem)
    assert support, support.reason
    extra = {} if segs is None else {"q_segment_ids": segs, "kv_segment_ids": segs}

    def loss(q, k, v):
        out = kernel(problem, q, k, v, **extra)
        return jnp.sum(out * cs), out

    shard = NamedSharding(mesh, spec_q)
    args = [jax.device_put(x, shard) for x in (qs, ks, vs)]
    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    inverse = np.argsort(perm)
    out, grads = np.asarray(out)[:, inverse], [np.asarray(g)[:, inverse] for g in grads]

    def err(got, want):
        return float(np.max(np.abs(got - np.asarray(want))) / max(1.0, float(np.max(np.abs(want)))))

    return {"out": err(out, want_out), **{f"d{n}": err(g, w) for n, g, w in zip("qkv", grads, want_grads)}}


def kernel_checks() -> dict:
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, CONTEXT), ("data", "context"))
    cases = {
        "causal": dict(heads=2, kv_heads=2),
        "causal_balanced_gqa_segments_window": dict(heads=6, kv_heads=2, balance=True, segments=True, window=7, softcap=5.0),
    }
    out = {}
    with op_environment(mesh):
        # block_q 3: each device's 8 queries folded in pieces of 3, 3, 2 (3, 1 and 3, 1 under zigzag).
        for kernel in (RingAttention(block_q=3), AllGatherAttention()):
            for name, kwargs in cases.items():
                out[f"{kernel.name}/{name}"] = kernel_case(mesh, kernel, **kwargs)
    return out


STEPS = 20


def train(extra: list[str], shape: dict[str, int], initial=None):
    """(initial host state, losses, {op: kernels}) of STEPS steps of the tiny model on a mesh of `shape`."""
    from axcore.data import Split
    from axcore.experiment import load_experiment
    from axcore.kernels import describe_kernel_choices, record_kernel_choices
    from axcore.testing import TINY_OVERRIDES
    from axcore.trainer.trainer import Trainer

    overrides = [
        *TINY_OVERRIDES, f"trainer.max_steps={STEPS}", "trainer.learner.schedule.warmup_steps=2",
        "model.decoder.layer.self_attention.num_heads=4", "model.decoder.layer.self_attention.num_kv_heads=2",
        f"mesh.mesh_shape=[{','.join(map(str, shape.values()))}]", f"mesh.mesh_axis_names=[{','.join(shape)}]", *extra,
    ]
    exp = load_experiment(None, overrides)
    trainer = Trainer(exp, devices=jax.devices()[: math.prod(shape.values())])
    state = trainer.step.init_state() if initial is None else jax.device_put(initial, trainer.step.state_shardings)
    init = jax.device_get(state)
    with record_kernel_choices() as choices:
        step = trainer.step.compiled_train_step().lower(state, trainer.step.abstract_batch()).compile()
    with trainer.step.op_environment():
        shards = trainer.step.model.context_shards((exp.config.input.batch_size, exp.config.input.seq_len))
    batches = exp.config.input.make_iterator(Split.TRAIN, trainer.step.tokenizer)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, jax.device_put(next(batches), trainer.step.batch_sharding))
        losses.append(metrics["loss"])
    return init, [float(x) for x in jax.device_get(losses)], describe_kernel_choices(choices), shards


def training_runs() -> dict:
    runs = {}
    init, losses, kernels, shards = train([], {"data": 1})
    runs["one_device"] = {"losses": losses, "reference": None, "kernels": kernels, "context_shards": shards}
    ring = ["model.decoder.layer.self_attention.kernel=context_ring"]
    _, losses, kernels, shards = train(ring, {"data": 2, "context": 4}, init)
    runs["data2_context4_ring"] = {"losses": losses, "reference": "one_device", "kernels": kernels, "context_shards": shards}
    return runs


def main() -> None:
    start = time.time()
    results = {"kernels": {} if os.environ.get("SKIP_KERNELS") else kernel_checks()}
    middle = time.time()
    results["runs"] = training_runs()
    results["seconds"] = {"kernels": middle - start, "runs": time.time() - middle}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
