"""The engine's steps on the CPU with axcore's own kernels and with axcore-cpu's (`openblas`, `cpu_paged_decode`).

    python -m benchmarks.cpu_kernels RUN_DIR [--rounds 7] [--json OUT]
    python -m benchmarks.cpu_kernels --smoke     # a tiny random model; numbers mean nothing

RUN_DIR is a run or import directory (the 135M import `serve_throughput.py --work-dir DIR`
leaves in `DIR/import-135m`). Two engines' model runners share one parameter tree: `xla`
with `EngineConfig.kernels={dot: xla, paged_attention: xla_cpu_decode}` (what axcore runs
without axcore-cpu: XLA's dot, its own decode kernel) and `default`, the default choice
(with axcore-cpu installed, `openblas` for every weight matmul of more than one row and
`cpu_paged_decode` for decode attention). Each runs the step shapes of the serving benchmark's concurrency-32 replay: decode
steps (`B` rows, one token each, block tables `W` wide, contexts in the table's upper
half, blocks in order as the engine's free list gives them) and prefill chunks (`B` rows
of `T` tokens). The two runners alternate call by call; medians and p10-p90 of wall
milliseconds per step, their ratio, the dot and paged attention kernels each chose, and
the largest difference of their logits are printed as JSON.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from benchmarks.common import compare_runners, emit_report, runner_benchmark_args

# (rows, tokens per row, table width): decode steps, then prefill chunks.
SHAPES = ((16, 1, 1), (32, 1, 1), (4, 1, 32), (16, 1, 32), (32, 1, 32), (16, 1, 64), (32, 1, 64), (1, 256, 16), (4, 128, 16))
SMOKE_SHAPES = ((4, 1, 2), (2, 8, 2))


def step_arrays(rng: np.random.Generator, rows: int, tokens: int, width: int, block_size: int, vocab: int):
    """`(tokens, positions, num_new, tables)` of a step: each row's new tokens end inside its table."""
    slots = width * block_size
    lowest = max(slots // 2 - tokens, 0) if tokens == 1 else 0
    starts = rng.integers(lowest, slots - tokens + 1, rows)
    tables = np.zeros((rows, width), np.int32)
    for row in range(rows):
        used = (starts[row] + tokens - 1) // block_size + 1
        tables[row, :used] = 1 + row * width + np.arange(used)
    ids = rng.integers(1, vocab, (rows, tokens)).astype(np.int32)
    positions = (starts[:, None] + np.arange(tokens)[None, :]).astype(np.int32)
    return ids, positions, np.full(rows, tokens, np.int32), tables


def runners(run_dir: str | None) -> tuple[Any, Any, Any]:
    """`(runner with axcore's own kernels, default runner, params)` on one parameter tree."""
    from axcore.engine import Engine, EngineConfig
    from axcore.inference import load_model

    if run_dir is None:  # --smoke: a tiny random model.
        from axcore.experiment import load_experiment
        from axcore.testing import TINY_OVERRIDES

        exp = load_experiment(None, [*TINY_OVERRIDES, "model.compute_dtype=float32"])
        model = exp.config.model.instantiate(name="model", registries=exp.registries)
        params = model.initialize(jax.random.key(0))
        sizes = {"num_blocks": 64}
    else:
        loaded = load_model(run_dir)
        model, params = loaded.model, loaded.params
        sizes = {"kv_cache_bytes": 2 << 30}  # 32 rows x 64 blocks fit.
    make = lambda kernels: Engine(model, params, None, config=EngineConfig(  # noqa: E731
        max_seqs=32, max_tokens_per_step=256, kernels=kernels, **sizes)).runner
    return make({"dot": "xla", "paged_attention": "xla_cpu_decode"}), make(None), params


def main(argv: list[str] | None = None) -> dict:
    args = runner_benchmark_args("python -m benchmarks.cpu_kernels", __doc__, argv)
    reference, default, params = runners(None if args.smoke else args.run_dir)
    rounds = 2 if args.smoke else args.rounds
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {"benchmark": "cpu_kernels", "run_dir": args.run_dir, "smoke": args.smoke,
                              "jax": jax.__version__, "shapes": {}}
    contenders = (("xla", reference), ("default", default))
    for rows, tokens, width in SMOKE_SHAPES if args.smoke else SHAPES:
        arrays = step_arrays(rng, rows, tokens, width, default.block_size, int(default.model.config.vocab_size))
        entry = compare_runners(contenders, params, arrays, rounds, ("dot", "paged_attention"))
        report["shapes"][f"B{rows}xT{tokens}xW{width}"] = entry
        print(f"B={rows} T={tokens} W={width}: xla {entry['xla']['median_ms']:.1f} ms, default {entry['kernels']['default']} "
              f"{entry['default']['median_ms']:.1f} ms (x{entry['ratio_default_over_xla']:.2f}), "
              f"logits differ by {entry['logits_max_abs_diff']:.2e}", file=sys.stderr)
    emit_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
