"""Long context: per-device memory of a 1B Llama train step at 131,072 tokens on 8 devices.

`python -m benchmarks.long_context` (sets `--xla_force_host_platform_device_count=8`
itself) compiles the train step of `benchmarks/experiments/llama3_1b_128k.yaml` on
abstract inputs (`axcore.trainer.compile_analysis.compile_step`: nothing is allocated) in several
configurations and prints one markdown row each: per-device bytes of arguments,
temporaries and the estimated peak (argument + output + temp - alias), as
`axcore compile` reports them.

By default (the `long-context` rule) the sequence is split over a `context` mesh axis
of the 8 devices and attention runs in the context-parallel kernels (`context_ring`
above 8,192 keys: each device keeps its 16,384 queries and passes key/value blocks
around the ring), with zigzag load balancing. `sequence_gspmd_xla` splits it over a
`sequence` axis instead, where XLA partitions axcore's reference attention (`xla`) itself;
that kernel materialises `[batch, heads, queries, keys]` float32 scores, 275 GB per
device for 16,384 queries x 131,072 keys x 32 heads. Each row names the attention
kernel the step used.

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
# name -> (overrides, the decoder's remat_policy if not the mesh rule's, what it shows). The policy is set
# after loading: the mesh rule's remat modifier wins over an override.
CONFIGURATIONS = {
    "without": (["mesh.rule=no-context", "model.loss_chunk_len=null"], None,
                "no sequence split, unchunked loss, no remat"),
    "with": ([], None, "context axis, chunked loss, offload remat"),
    "with_full_remat": ([], "nothing_saveable", "as `with`, remat full (what `with` keeps on a GPU/TPU device)"),
    "with_matmul_outputs_saved": ([], "dots_with_no_batch_dims_saveable", "as `with`, the residuals saved on the device"),
    "with_unchunked_loss": (["model.loss_chunk_len=null"], None, "as `with`, unchunked loss"),
    "with_no_remat": ([], "", "as `with`, no remat"),
    "sequence_gspmd_xla": (["mesh.rule=sequence-gspmd"], None, "sequence axis (GSPMD), chunked loss, offload remat"),
}


def measure(name: str) -> dict:
    from axcore.experiment import load_experiment
    from axcore.kernels import record_kernel_choices
    from axcore.trainer.compile_analysis import compile_step
    from axcore.trainer.memory_check import estimated_peak

    overrides, policy, what = CONFIGURATIONS[name]
    experiment = load_experiment(EXPERIMENT, ["mesh.instance_type=cpu-8", *overrides])
    if policy is not None:
        config = experiment.config.clone()
        config.model.decoder.remat_policy = policy or None
        experiment = dataclasses.replace(experiment, config=config)
    assert experiment.config.model.decoder.remat_policy == (
        "offload_dot_with_no_batch_dims(device,pinned_host)" if policy is None and name != "without" else policy or None
    ), experiment.config.model.decoder.remat_policy
    t0 = time.perf_counter()
    with record_kernel_choices() as choices:
        step = compile_step(experiment)
    mem = step.memory
    return {
        "name": name, "what": what, "mesh": step.mesh, "seconds": time.perf_counter() - t0,
        "attention": ", ".join(sorted(choices.get("attention", {}))),
        "argument": mem["argument"], "temp": mem["temp"],
        "peak": estimated_peak(mem),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CONFIGURATIONS), help="configurations to compile")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print("| configuration | what | attention | arguments GB | temporaries GB | peak GB | below 80 GB | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.names:
        r = measure(name)
        print(f"| `{name}` | {r['what']} | {r['attention']} | {r['argument'] / 1e9:.2f} | {r['temp'] / 1e9:.2f} | {r['peak'] / 1e9:.2f} | "
              f"{'yes' if r['peak'] < 80e9 else 'no'} | {r['seconds']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
