"""Two small GPU probes for issue 27: which fp8 matmul form becomes a cuBLASLt fp8 GEMM, and which
programs make a jitted call block the host.

    python -m benchmarks.gpu_probes [--tokens 16384 --k 2048 --n 8192] [--calls 20]
    python -m benchmarks.gpu_probes --smoke      # tiny shapes on CPU (CI); numbers mean nothing

**fp8 forms.** axcore's `fp8` dot kernel (`axcore_gpu/fp8_dot.py`) writes the matmul as
quantize-dequantize in the compute dtype followed by a float32-accumulated dot, the pattern
XLA's GemmRewriter is documented to turn into `__cublas$lt$matmul$f8`. On an H200 with JAX
0.11.2 the whole 0.89B step compiled to bf16 dots instead (and ran 1.10x slower than bf16).
Each form below is compiled for x `[tokens, k]` and w `[k, n]` (bf16 compute) and reported
with its custom-call targets, its matmul dtypes and the median time of one forward call:

- `bf16`: the plain bf16 dot (the baseline);
- `qdq_f32acc`: the kernel's form (dequantize in bf16, dot with float32 accumulation, cast);
- `qdq_bf16out`: the same dot with a bf16 result type;
- `qdq_f32`: dequantize into float32, float32 dot, cast;
- `direct`: the fp8 arrays straight into `dot_general` (preferred bf16), the scalar scales
  multiplied into the result afterwards (equal to the dequantized product: per-tensor scales
  are scalars);
- `direct_e5m2`: as `direct` with an e5m2 left operand (the backward pass's gradient).
Each again compiled with `xla_gpu_enable_triton_gemm=False` (suffix `/no_triton`).

**Host blocking.** A chain of `--chain` bf16 matmuls (`[m, m]`, tanh between) and a chain of
elementwise steps of similar length, each jitted with a donated input and called `--calls`
times back to back: the median host time of one call over the device time per call (near 1:
the call blocks; near 0: the host runs ahead).

Results: `benchmarks/results/gpu_probes.json` and a printed summary.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.step_accounting import hlo_matmuls

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def fp8_forms() -> dict[str, Any]:
    """name -> f(x, w, sx, sw): bf16 x `[t, k]`, w `[k, n]`, float32 scalar scales -> bf16 `[t, n]`."""
    import jax
    import jax.numpy as jnp

    bf16, f32 = jnp.bfloat16, jnp.float32
    dims = (((1,), (0,)), ((), ()))

    def quantize(v, s, dtype):
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(v.astype(f32) / s, -top, top).astype(dtype)

    def qdq(v, s, dtype, into):
        return quantize(v, s, dtype).astype(into) * s.astype(into)

    def bf16_dot(x, w, sx, sw):
        return jax.lax.dot_general(x, w, dims)

    def qdq_f32acc(x, w, sx, sw):
        return jax.lax.dot_general(qdq(x, sx, E4M3, bf16), qdq(w, sw, E4M3, bf16), dims,
                                   preferred_element_type=f32).astype(bf16)

    def qdq_bf16out(x, w, sx, sw):
        return jax.lax.dot_general(qdq(x, sx, E4M3, bf16), qdq(w, sw, E4M3, bf16), dims)

    def qdq_f32(x, w, sx, sw):
        return jax.lax.dot_general(qdq(x, sx, E4M3, f32), qdq(w, sw, E4M3, f32), dims).astype(bf16)

    def direct(x, w, sx, sw, left=E4M3):
        y = jax.lax.dot_general(quantize(x, sx, left), quantize(w, sw, E4M3), dims, preferred_element_type=bf16)
        return (y.astype(f32) * (sx * sw)).astype(bf16)

    return {"bf16": bf16_dot, "qdq_f32acc": qdq_f32acc, "qdq_bf16out": qdq_bf16out, "qdq_f32": qdq_f32,
            "direct": direct, "direct_e5m2": lambda x, w, sx, sw: direct(x, w, sx, sw, left=E5M2)}


def _median_call_seconds(fn, args, calls: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_fp8(tokens: int, k: int, n: int, calls: int) -> dict[str, Any]:
    """Each fp8 form (and bf16) compiled with and without Triton GEMMs: custom calls, matmul dtypes, time."""
    import jax
    import jax.numpy as jnp

    rng = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(rng[0], (tokens, k), jnp.bfloat16)
    w = (jax.random.normal(rng[1], (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sx = (jnp.max(jnp.abs(x)).astype(jnp.float32) / 448.0)
    sw = (jnp.max(jnp.abs(w)).astype(jnp.float32) / 448.0)
    want = jax.jit(fp8_forms()["bf16"])(x, w, sx, sw).astype(jnp.float32)
    out: dict[str, Any] = {}
    for name, form in fp8_forms().items():
        for suffix, options in (("", {}), ("/no_triton", {"xla_gpu_enable_triton_gemm": False})):
            key = name + suffix
            try:
                compiled = jax.jit(form).lower(x, w, sx, sw).compile(compiler_options=options or None)
                got = compiled(x, w, sx, sw).astype(jnp.float32)
                rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                seconds = _median_call_seconds(compiled, (x, w, sx, sw), calls)
                out[key] = {**hlo_matmuls(compiled.as_text()), "median_ms": 1e3 * seconds, "rel_error_vs_bf16": rel}
                out[key].pop("matmul_shapes", None)
            except Exception as e:  # noqa: BLE001 - a form the compiler refuses is a result too.
                out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"[gpu_probes] fp8 {key:24s} {json.dumps(out[key])[:400]}", flush=True)
    return out


def probe_host(m: int, chain: int, calls: int) -> dict[str, Any]:
    """Median host time of one call / device time per call, for a matmul chain and an elementwise chain."""
    import jax
    import jax.numpy as jnp

    def matmuls(x, w):
        for _ in range(chain):
            x = jnp.tanh(x @ w)
        return x

    def elementwise(x, w):
        for _ in range(chain):
            x = jnp.tanh(x * 1.0001 + 0.001)
        return x

    out = {}
    for name, fn in (("matmuls", matmuls), ("elementwise", elementwise)):
        x = jnp.ones((m, m), jnp.bfloat16)
        w = jnp.full((m, m), 1.0 / m, jnp.bfloat16)
        step = jax.jit(fn, donate_argnums=0)
        x = jax.block_until_ready(step(x, w))
        host = []
        start = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            x = step(x, w)
            host.append(time.perf_counter() - t)
        jax.block_until_ready(x)
        per_call = (time.perf_counter() - start) / calls
        out[name] = {"host_ms_median": 1e3 * statistics.median(host), "device_ms_per_call": 1e3 * per_call,
                     "host_over_step": statistics.median(host) / per_call}
        print(f"[gpu_probes] host {name:12s} {json.dumps(out[name])}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_probes", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI); numbers mean nothing")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--m", type=int, default=4096, help="host probe: matrix size")
    p.add_argument("--chain", type=int, default=100, help="host probe: steps per call")
    p.add_argument("--results-dir", type=pathlib.Path)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.k, args.n, args.calls, args.m, args.chain = 32, 32, 48, 2, 32, 4
    import jax

    result = {"benchmark": "gpu_probes", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "jax_version": jax.__version__, "device_kind": jax.devices()[0].device_kind, "smoke": args.smoke,
              "shape": {"tokens": args.tokens, "k": args.k, "n": args.n}}
    result["fp8"] = probe_fp8(args.tokens, args.k, args.n, args.calls)
    result["host"] = probe_host(args.m, args.chain, args.calls)
    folder = args.results_dir or pathlib.Path(__file__).resolve().parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpu_probes.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
