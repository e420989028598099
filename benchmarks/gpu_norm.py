"""RMSNorm kernels on a GPU: forward, and forward + backward, per call (issue 27, item 1).

    python -m benchmarks.gpu_norm [--rows 16384 --width 2048] [--calls 20] [--rounds 7]
    python -m benchmarks.gpu_norm --smoke      # tiny, CPU, Pallas interpreted; numbers mean nothing

Contenders: the `rms_norm` op's kernels, `xla` (the reference), `fused_vjp` and `pallas`
(`axcore_gpu.fused_norm`, default options plus `--pallas` option sets
`block_rows,num_warps,max_programs`). Each is timed as `--calls` chained calls inside
one jit (an optimization barrier between calls, as a model has matmuls between its
norms; every output materialized), so dispatch costs nothing; per-call time = the
call's median over alternated rounds / calls. The memory floor per call: forward reads
x and writes y (2 x rows x width x 2 bytes in bfloat16), backward reads x and dy and
writes dx (3 x ...); divide by the device's copy bandwidth. Results:
`benchmarks/results/gpu_norm.json` and a printed table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

EPS = 1e-6


def chained(kernel, calls: int, backward: bool, scale, dy):
    """jit of `calls` chained norm calls (with their VJPs when `backward`)."""
    import jax
    import jax.numpy as jnp

    from axcore.kernels import rms_norm_problem

    def norm(x, s):
        return kernel(rms_norm_problem(x, s, eps=EPS), x, s)

    def run(x):
        outputs, dscale = [], jnp.zeros(scale.shape, jnp.float32)
        for _ in range(calls):
            if backward:
                y, vjp = jax.vjp(norm, x, scale)
                dx, ds = vjp(dy)
                outputs.append(y)
                x, dscale = dx, dscale + ds
            else:
                x = norm(x, scale)
            x = jax.lax.optimization_barrier(x)  # No fusion across calls.
        return x, dscale, outputs

    return jax.jit(run)


def kernels(args) -> dict[str, Any]:
    from axcore.kernels import XlaRMSNorm

    found = {"xla": XlaRMSNorm()}
    try:
        from axcore_gpu.fused_norm import FusedVjpRMSNorm, PallasRMSNorm
    except ImportError:
        return found
    found["fused_vjp"] = FusedVjpRMSNorm()
    found["pallas"] = PallasRMSNorm(interpret=args.smoke)
    for option in args.pallas:
        rows, warps, programs = (int(v) for v in option.split(","))
        found[f"pallas[{option}]"] = PallasRMSNorm(
            interpret=args.smoke, block_rows=rows, num_warps=warps, max_programs=programs
        )
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import alternate, summarize, write_result

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.rows, args.width)), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(args.rows, args.width)), jnp.bfloat16)
    scale = jnp.ones((args.width,), jnp.float32)
    timers = {}
    for name, kernel in kernels(args).items():
        for backward in (False, True):
            fn = chained(kernel, args.calls, backward, scale, dy)
            jax.block_until_ready(fn(x))

            def once(fn=fn):
                start = time.perf_counter()
                jax.block_until_ready(fn(x))
                return (time.perf_counter() - start) / args.calls

            timers[(name, "forward+backward" if backward else "forward")] = once
    times = alternate({f"{n}|{p}": fn for (n, p), fn in timers.items()}, args.rounds)
    results: dict[str, dict] = {}
    for key, series in times.items():
        name, part = key.split("|")
        results.setdefault(name, {})[part] = summarize(series)
    elements = args.rows * args.width
    data = {
        "smoke": args.smoke,
        "shape": [args.rows, args.width],
        "dtype": "bfloat16",
        "calls": args.calls,
        "rounds": args.rounds,
        "floor_bytes": {"forward": 2 * elements * 2, "forward+backward": 5 * elements * 2},
        "results": results,
    }
    write_result("gpu_norm", data, results_dir=args.results_dir)
    print("| kernel | forward ms | forward + backward ms |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {1e3 * r['forward']['median']:.4f} | {1e3 * r['forward+backward']['median']:.4f} |")
    return data


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_norm", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, Pallas interpreted")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pallas", nargs="*", default=["4,4,264", "1,4,1024"], help="block_rows,num_warps,max_programs")
    p.add_argument("--results-dir", type=pathlib.Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.rows, args.width, args.calls, args.rounds, args.pallas = 64, 96, 2, 1, []
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
