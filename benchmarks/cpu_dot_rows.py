"""XLA:CPU's dot against axcore-cpu's products (sgemm, rows) on a 135M decoder's weight matrices, by row count.

    python -m benchmarks.cpu_dot_rows [--rows 1 2 4 8 16 32 64 256] [--rounds 7] [--json OUT]
    python -m benchmarks.cpu_dot_rows --smoke     # small matrices; numbers mean nothing

Which of axcore-cpu's dot kernels should serve on this CPU, up to how many rows: three jitted programs
run the weight products of SmolLM-135M's shape (30 layers of q, k, v, o, gate, up and
down projections, then the tied head `[vocab, dim]` transposed; random float32 weights;
a residual, SwiGLU and a cheap norm between them so nothing is folded away) on `rows`
rows, one with XLA's dot (`xla`), one with the `axcore_cpu_sgemm` FFI call (`sgemm`,
OpenBLAS with one BLAS thread, the columns split over XLA's intra-op threads; the `openblas`
kernel), one with the `axcore_cpu_rows_dot` FFI call (`rows`, the `cpu_rows` kernel's
product, every row count here, though the kernel hands more than 32 rows, 16 for the head,
to XLA). They alternate call by call; medians and p10-p90 of wall milliseconds, the ratios
sgemm / xla and rows / xla and the largest difference of each output from XLA's are printed
as JSON.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import alternate, emit_report, milliseconds, timed

# SmolLM-135M: width, FFN width, key/value width (3 kv heads x 64), layers, vocabulary.
SHAPE = {"dim": 576, "ffn": 1536, "kv": 192, "layers": 30, "vocab": 49152}
SMOKE_SHAPE = {"dim": 64, "ffn": 128, "kv": 32, "layers": 2, "vocab": 500}


def weights(shape: dict[str, int], seed: int = 0) -> tuple[list[dict[str, Any]], Any]:
    """Random float32 `(layers, head)` of `shape`: each layer's projections `[in, out]`, the head `[vocab, dim]`."""
    rng = np.random.default_rng(seed)
    d, f, kv = shape["dim"], shape["ffn"], shape["kv"]
    dims = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
    layers = [{name: rng.standard_normal(s, np.float32) / np.sqrt(s[0]) for name, s in dims.items()}
              for _ in range(shape["layers"])]
    head = rng.standard_normal((shape["vocab"], d), np.float32) / np.sqrt(d)
    return jax.device_put(layers), jax.device_put(head)


def decoder(dot, dot_t):
    """A jitted `(x [rows, dim], layers, head) -> logits [rows, vocab]` whose products go through `dot(x, w)`
    (w `[in, out]`) and `dot_t(x, head)` (head `[vocab, dim]`)."""

    def run(x, layers, head):
        for w in layers:
            q, k, v = dot(x, w["q"]), dot(x, w["k"]), dot(x, w["v"])
            x = x + dot(q, w["o"]) + 0.0 * (k.sum() + v.sum())
            x = x + dot(jax.nn.silu(dot(x, w["gate"])) * dot(x, w["up"]), w["down"])
            x = x / (1.0 + jnp.abs(x).mean(-1, keepdims=True))
        return dot_t(x, head)

    return jax.jit(run)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_dot_rows", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=7, help="timed calls per contender and row count, alternated")
    parser.add_argument("--smoke", action="store_true", help="small matrices, 2 rounds, rows 1 and 4")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    from axcore_cpu.openblas_dot import sgemm
    from axcore_cpu.rows_dot import rows_dot

    shape = SMOKE_SHAPE if args.smoke else SHAPE
    rows, rounds = ([1, 4], 2) if args.smoke else (args.rows, args.rounds)
    layers, head = weights(shape)
    programs = {"xla": decoder(lambda a, b: a @ b, lambda a, b: a @ b.T),
                "sgemm": decoder(lambda a, b: sgemm(a, b, trans_w=False), lambda a, b: sgemm(a, b, trans_w=True)),
                "rows": decoder(lambda a, b: rows_dot(a, b, trans_w=False), lambda a, b: rows_dot(a, b, trans_w=True))}
    report: dict[str, Any] = {"benchmark": "cpu_dot_rows", "smoke": args.smoke, "shape": shape,
                              "jax": jax.__version__, "rows": {}}
    rng = np.random.default_rng(1)
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, shape["dim"]), np.float32))
        outs = {name: np.asarray(program(x, layers, head)) for name, program in programs.items()}  # Compiles.
        times = alternate({name: (lambda p=program, x=x: timed(lambda: jax.block_until_ready(p(x, layers, head))))
                           for name, program in programs.items()}, rounds)
        entry: dict[str, Any] = {name: milliseconds(t) for name, t in times.items()}
        for name in ("sgemm", "rows"):
            entry[f"ratio_{name}_over_xla"] = entry[name]["median_ms"] / entry["xla"]["median_ms"]
            entry[f"max_abs_diff_{name}"] = float(np.abs(outs["xla"] - outs[name]).max())
        report["rows"][str(m)] = entry
        print(f"rows {m}: xla {entry['xla']['median_ms']:.1f} ms, sgemm {entry['sgemm']['median_ms']:.1f} ms "
              f"(x{entry['ratio_sgemm_over_xla']:.2f}), rows {entry['rows']['median_ms']:.1f} ms "
              f"(x{entry['ratio_rows_over_xla']:.2f}), outputs differ by {entry['max_abs_diff_sgemm']:.1e} / "
              f"{entry['max_abs_diff_rows']:.1e}", file=sys.stderr)
    emit_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
