"""Long context: per-device memory of a 1B Llama train step at 131,072 tokens on 8 devices.

`python -m benchmarks.long_context` (sets `--xla_force_host_platform_device_count=8`
itself) compiles the train step of `benchmarks/experiments/llama3_1b_128k.yaml` on
abstract inputs (`axcore.cli.compile.compile_step`: nothing is allocated) in several
configurations and prints one markdown row each: per-device bytes of arguments,
temporaries and the estimated peak (argument + output + temp - alias), as
`axcore compile` reports them.

The sequence is split over the devices by GSPMD (the `seq` logical axis on the
`sequence` mesh axis), not by a context-parallel kernel: attention then computes each
device's queries against the whole (gathered) keys. axcore's reference attention
(`xla`) materialises the `[batch, heads, queries, keys]` float32 scores, 275 GB per
device for 16,384 queries x 131,072 keys x 32 heads, so no setting fits 80 GB with it.
The rows marked `query_chunked` register a stand-in kernel here, in this process
only (`QueryChunkedAttention`: the reference kernel on 1,024-query chunks under
`lax.map` and `jax.checkpoint`, the memory profile of an all-gather context kernel);
the context-parallel kernels of issue 26 replace it.

Host offloading is not measured by the CPU backend: JAX drops memory kinds when it
lowers for CPU, so the `offload_matmul_outputs` rows count the offloaded residuals in
device memory. On GPU and TPU they live in `pinned_host` memory (the lowering for
those targets places them there: plugins/remat/tests/test_remat.py); the `full` row
(nothing saved but each layer's input) bounds what the device then holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

EXPERIMENT = str(pathlib.Path(__file__).parent / "experiments" / "llama3_1b_128k.yaml")
# Queries per chunk of the stand-in kernel.
QUERY_CHUNK = 1024
STAND_IN = "plugins=[rope, swiglu, query_chunked]"
# name -> (overrides, the decoder's remat_policy if not the mesh rule's, what it shows). The policy is set
# after loading: the mesh rule's remat modifier wins over an override.
CONFIGURATIONS = {
    "without": (["mesh.rule=no-context", "model.loss_chunk_len=null"], None,
                "no sequence sharding, unchunked loss, no remat, xla attention"),
    "with_xla_attention": ([], None, "sequence sharding, chunked loss, offload remat, xla attention"),
    "with": ([STAND_IN], None, "sequence sharding, chunked loss, offload remat, query_chunked attention"),
    "with_full_remat": ([STAND_IN], "nothing_saveable",
                        "as `with`, remat full (what `with` keeps on a GPU/TPU device, offload aside)"),
    "with_matmul_outputs_saved": ([STAND_IN], "dots_with_no_batch_dims_saveable",
                                  "as `with`, the same residuals saved on the device"),
    "with_unchunked_loss": ([STAND_IN, "model.loss_chunk_len=null"], None, "as `with`, unchunked loss"),
    "with_no_remat": ([STAND_IN], "", "as `with`, no remat"),
}


def query_chunked_plugin():
    """A plugin object registering `QueryChunkedAttention` (this benchmark's stand-in, see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from axcore.kernels import ATTENTION, Support, XlaAttention
    from axcore.markers import hookimpl

    reference = XlaAttention()

    class QueryChunkedAttention:
        """The reference kernel over strided query chunks (chunk j: queries j, j + n, ...; n chunks), each
        recomputed in the backward pass; causal masking by position, as an additive bias."""

        name = "query_chunked"
        priority = 10

        def is_supported(self, problem):
            if problem.q_len != problem.kv_len or problem.q_len % QUERY_CHUNK or problem.q_len < 4 * QUERY_CHUNK:
                return Support(False, f"needs q_len == kv_len, a multiple of {4 * QUERY_CHUNK}")
            if problem.sliding_window or problem.bias_slopes or problem.bias_fn or problem.has_bias:
                return Support(False, "no sliding window or bias")
            return reference.is_supported(problem)

        def __call__(self, problem, q, k, v, *, kv_mask=None, q_segment_ids=None, kv_segment_ids=None,
                     q_positions=None, kv_positions=None, bias=None, dropout_key=None):
            batch, length = q.shape[:2]
            count = length // QUERY_CHUNK

            def split(a):  # [b, t, ...] -> [count, b, QUERY_CHUNK, ...]
                return jnp.moveaxis(a.reshape(batch, QUERY_CHUNK, count, *a.shape[2:]), 2, 0)

            index = jnp.arange(length)
            sub = dataclasses.replace(problem, q_len=QUERY_CHUNK, causal=False, has_bias=problem.causal)

            def one(xs):
                q_chunk, q_index, q_segments = xs
                mask = None
                if problem.causal:
                    mask = jnp.where(q_index[:, None, :, None] >= index, 0.0, -1e30).astype(jnp.float32)
                return reference(sub, q_chunk, k, v, kv_mask=kv_mask, q_segment_ids=q_segments,
                                 kv_segment_ids=kv_segment_ids, bias=mask, dropout_key=dropout_key)

            segments = None if q_segment_ids is None else split(q_segment_ids)
            out = jax.lax.map(jax.checkpoint(one), (split(q), split(jnp.broadcast_to(index, (batch, length))), segments))
            return jnp.moveaxis(out, 0, 2).reshape(q.shape)

    class Plugin:
        @hookimpl
        def axcore_register_kernels(self, register):
            register(ATTENTION, QueryChunkedAttention())

    return Plugin()


def measure(name: str) -> dict:
    from axcore.cli.compile import compile_step
    from axcore.experiment import load_experiment

    overrides, policy, what = CONFIGURATIONS[name]
    experiment = load_experiment(
        EXPERIMENT, ["mesh.instance_type=cpu-8", *overrides], objects={"query_chunked": query_chunked_plugin()}
    )
    if policy is not None:
        config = experiment.config.clone()
        config.model.decoder.remat_policy = policy or None
        experiment = dataclasses.replace(experiment, config=config)
    assert experiment.config.model.decoder.remat_policy == (
        "offload_dot_with_no_batch_dims(device,pinned_host)" if policy is None and name != "without" else policy or None
    ), experiment.config.model.decoder.remat_policy
    t0 = time.perf_counter()
    step = compile_step(experiment)
    mem = step.memory
    return {
        "name": name, "what": what, "mesh": step.mesh, "seconds": time.perf_counter() - t0,
        "argument": mem["argument"], "temp": mem["temp"],
        "peak": mem["argument"] + mem["output"] + mem["temp"] - mem["alias"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CONFIGURATIONS), help="configurations to compile")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print("| configuration | what | arguments GB | temporaries GB | peak GB | below 80 GB | compile s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.names:
        r = measure(name)
        print(f"| `{name}` | {r['what']} | {r['argument'] / 1e9:.2f} | {r['temp'] / 1e9:.2f} | {r['peak'] / 1e9:.2f} | "
              f"{'yes' if r['peak'] < 80e9 else 'no'} | {r['seconds']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
