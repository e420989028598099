"""The engine's decode step on XLA:CPU with the reference `xla` paged attention kernel and `xla_cpu_decode`.

    python -m benchmarks.paged_decode_cpu RUN_DIR [--rounds 7] [--json OUT]
    python -m benchmarks.paged_decode_cpu --smoke     # a tiny random model; numbers mean nothing

RUN_DIR is a run or import directory (the 135M import `serve_throughput.py --work-dir DIR`
leaves in `DIR/import-135m`). Two engines' model runners are built on the same parameters,
one with `model.kernels={paged_attention: xla}` (the reference) and one with
`model.kernels={paged_attention: xla_cpu_decode}` (axcore's own CPU decode kernel, which
prefill chunks decline to the reference; axcore-cpu's native kernel is timed by `cpu_kernels.py`). Each runs decode steps (one new
token per row) at the shapes of the serving benchmark's concurrency-32 steps: `B` rows,
block tables `W` blocks wide, each row's context drawn between half and all of `W x
block_size` tokens, its blocks scattered over the cache. Also `W = 1` (contexts under one
block: the step without attention's reading). The two runners alternate call by call;
medians and p10-p90 of wall seconds per step, their ratio, and the largest difference of
the two kernels' logits are printed as JSON (`benchmarks.common.compare_runners`).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from benchmarks.common import compare_runners, emit_report, runner_benchmark_args

SHAPES = ((16, 1), (32, 1), (4, 32), (16, 32), (32, 32), (16, 64), (32, 64))


def step_arrays(rng: np.random.Generator, rows: int, width: int, block_size: int, num_blocks: int, vocab: int):
    """`(tokens, positions, num_new, tables)` of a decode step: contexts in the upper half of the table."""
    slots = width * block_size
    ends = rng.integers(slots // 2, slots, rows) if width > 1 else rng.integers(0, block_size, rows)
    blocks = rng.permutation(num_blocks - 1)[: rows * width].reshape(rows, width) + 1
    tables = np.where(np.arange(width)[None, :] <= (ends // block_size)[:, None], blocks, 0).astype(np.int32)
    tokens = rng.integers(1, vocab, (rows, 1)).astype(np.int32)
    return tokens, ends[:, None].astype(np.int32), np.ones(rows, np.int32), tables


def runners(run_dir: str | None) -> tuple[Any, Any, Any]:
    """`(reference runner, default runner, params)` on one parameter tree."""
    from axcore.engine import Engine, EngineConfig
    from axcore.inference import load_model

    config = EngineConfig(max_seqs=32, kv_cache_bytes=2 << 30, max_tokens_per_step=32)  # 2 GiB: 32 x 64 blocks fit.
    if run_dir is None:  # --smoke: a tiny random model.
        from axcore.experiment import load_experiment
        from axcore.testing import TINY_OVERRIDES

        def build(extra):
            exp = load_experiment(None, [*TINY_OVERRIDES, "model.compute_dtype=float32",
                                         "model.decoder.layer.self_attention.num_kv_heads=2", *extra])
            return exp.config.model.instantiate(name="model", registries=exp.registries)

        reference, default = build(["model.kernels={paged_attention: xla}"]), build(["model.kernels={paged_attention: xla_cpu_decode}"])
        params = default.initialize(jax.random.key(0))
        config = EngineConfig(max_seqs=32, num_blocks=512, max_tokens_per_step=32)
    else:
        loaded = load_model(run_dir, overrides=["model.kernels={paged_attention: xla}"])
        reference, params = loaded.model, loaded.params
        default = load_model(run_dir, overrides=["model.kernels={paged_attention: xla_cpu_decode}"]).model
    make = lambda model: Engine(model, params, None, config=config).runner  # noqa: E731
    return make(reference), make(default), params


def main(argv: list[str] | None = None) -> dict:
    args = runner_benchmark_args("python -m benchmarks.paged_decode_cpu", __doc__, argv)
    reference, default, params = runners(None if args.smoke else args.run_dir)
    shapes = ((4, 1), (4, 2)) if args.smoke else SHAPES
    rounds = 2 if args.smoke else args.rounds
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {"benchmark": "paged_decode_cpu", "run_dir": args.run_dir, "smoke": args.smoke,
                              "jax": jax.__version__, "shapes": {}}
    for rows, width in shapes:
        arrays = step_arrays(rng, rows, width, default.block_size, default.num_blocks, int(default.model.config.vocab_size))
        contenders = (("xla", reference), ("xla_cpu_decode", default))
        entry = compare_runners(contenders, params, arrays, rounds, ("paged_attention",))
        report["shapes"][f"B{rows}xW{width}"] = entry
        print(f"B={rows} W={width}: xla {entry['xla']['median_ms']:.1f} ms, xla_cpu_decode "
              f"{entry['xla_cpu_decode']['median_ms']:.1f} ms (x{entry['ratio_default_over_xla']:.2f}), "
              f"logits differ by {entry['logits_max_abs_diff']:.2e}", file=sys.stderr)
    emit_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
