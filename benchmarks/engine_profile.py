"""Where an engine step's time goes on `serve_throughput.py`'s workload, in-process (no HTTP).

    python -m benchmarks.engine_profile RUN_DIR [--concurrency 32] [--max-seqs 32] [--kv-gib 2]
        [--max-tokens-per-step 256] [--kernels OP=KERNEL ...] [--ragged auto|on|off] [--json OUT]

RUN_DIR is the 135M import `serve_throughput.py --work-dir DIR` leaves (`DIR/import-135m`).
The engine is built as `axcore serve` builds it (`axcore.inference.load_engine`; `--kernels`
sets `EngineConfig.kernels`, e.g. `dot=xla paged_attention=xla_cpu_decode` for axcore's own
kernels where axcore-cpu is installed), then the
benchmark's concurrency-C level is replayed: its C requests (the same seeded length mix,
greedy, `ignore_eos`) are added at once, as C closed-loop clients send them, and
`Engine.step` runs until they finish. A warm-up pass (other prompt ids) compiles first;
the timed pass then reports per step: rows (decode / prefill), valid tokens, each model
call's padded `(B, T, W)` and its wall and process-CPU time (`block_until_ready`), the
draw's time, the rest of the step (scheduler, packing, bookkeeping), and programs compiled
inside the timed pass (0 after a warm-up; with `--no-warm-up` the calls that compiled are
left out of the per-shape times and `wall_without_compile_s`). Totals at the end: output tokens/s, padded/valid
token ratio, and the share of each part.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from benchmarks.serve_throughput import length_mix, prompts_for


class _Timer:
    """Wraps the engine's runner step and draw to time them (outputs blocked on)."""

    def __init__(self, engine: Any):
        self.calls: list[dict[str, Any]] = []
        self.sample_s = 0.0
        runner = engine.runner
        # The unwrapped callables (a second timer on the same engine wraps those, not the first timer's).
        inner_step = runner.__dict__.get("_profile_inner_step", runner.step)
        sample = engine.__dict__.get("_profile_inner_sample", engine._sample)
        runner._profile_inner_step, engine._profile_inner_sample = inner_step, sample

        def step(params, tokens, positions, num_new, tables, **kw):
            ragged = kw.get("logit_rows") is not None  # One token per row (`EngineConfig.ragged_steps`).
            shape = runner.padded_shape(tokens.shape[0], tokens.shape[1], tables.shape[1], ragged=ragged)
            wall, cpu, programs = time.perf_counter(), time.process_time(), runner.num_programs
            out = jax.block_until_ready(inner_step(params, tokens, positions, num_new, tables, **kw))
            self.calls.append({"shape": shape, "rows": int(tokens.shape[0]), "valid": int(np.sum(num_new)),
                               "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                               "compiled": runner.num_programs > programs})
            return out

        def draw(*args):
            start = time.perf_counter()
            out = jax.block_until_ready(sample(*args))
            self.sample_s += time.perf_counter() - start
            return out

        runner.step, engine._sample = step, draw


def replay(engine: Any, work: list[tuple[list[int], int]], tag: str) -> dict[str, Any]:
    """Adds every request of `work` at once and steps until all finish; -> per-step records and totals."""
    from axcore.engine.requests import GenerationRequest, SamplingParams

    timer = _Timer(engine)
    compiled = engine.runner.num_programs
    requests = [GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                                       ignore_eos=True))
                for i, (prompt, n) in enumerate(work)]
    steps = []
    start, cpu0 = time.perf_counter(), time.process_time()
    first_token: dict[str, float] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        before_calls, before_sample = len(timer.calls), timer.sample_s
        t0 = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - t0
        now = time.perf_counter() - start
        for out in outputs:
            first_token.setdefault(out.request_id, now)
        calls = timer.calls[before_calls:]
        steps.append({"wall_s": wall, "calls": calls, "sample_s": timer.sample_s - before_sample,
                      "other_s": wall - sum(c["wall_s"] for c in calls) - (timer.sample_s - before_sample)})
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    out_tokens = sum(n for _, n in work)
    calls = [c for s in steps for c in s["calls"]]
    model = sum(c["wall_s"] for c in calls)
    sample = sum(s["sample_s"] for s in steps)
    padded = sum(int(np.prod(c["shape"][:2])) for c in calls)
    valid = sum(c["valid"] for c in calls)
    by_shape: dict[str, list[float]] = collections.defaultdict(list)
    for c in calls:
        if not c["compiled"]:
            by_shape[str(c["shape"])].append(c["wall_s"])
    compiling = [c for c in calls if c["compiled"]]
    ttft = sorted(first_token.values())
    return {"wall_s": wall, "cpu_s": cpu, "steps": len(steps), "model_calls": len(calls),
            "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "model_s": model, "model_cpu_s": sum(c["cpu_s"] for c in calls), "sample_s": sample,
            "other_s": wall - model - sample, "padded_tokens": padded, "valid_tokens": valid,
            "compiled_in_timed": engine.runner.num_programs - compiled,
            "compile_calls_s": sum(c["wall_s"] for c in compiling),
            "wall_without_compile_s": wall - sum(c["wall_s"] for c in compiling),
            "by_shape": {k: {"calls": len(v), "total_s": sum(v), "mean_ms": 1e3 * sum(v) / len(v)}
                         for k, v in sorted(by_shape.items(), key=lambda kv: -sum(kv[1]))},
            "per_step": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--kv-gib", type=float, default=2)
    parser.add_argument("--max-tokens-per-step", type=int, default=None)
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--kernels", nargs="*", default=[], metavar="OP=KERNEL",
                        help="kernels the engine's programs try first (EngineConfig.kernels)")
    parser.add_argument("--ragged", choices=["auto", "on", "off"], default="auto",
                        help="EngineConfig.ragged_steps: None (auto), True, False")
    parser.add_argument("--json", default=None, help="write the report (with every step) here")
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.kernels):
        parser.error(f"--kernels takes OP=KERNEL items, got {args.kernels}")
    from axcore.engine import EngineConfig
    from axcore.inference import load_engine

    fields = {"max_seqs": args.max_seqs, "kv_cache_bytes": int(args.kv_gib * (1 << 30))}
    if args.max_tokens_per_step:
        fields["max_tokens_per_step"] = args.max_tokens_per_step
    if args.kernels:
        fields["kernels"] = dict(item.split("=", 1) for item in args.kernels)
    fields["ragged_steps"] = {"auto": None, "on": True, "off": False}[args.ragged]
    engine = load_engine(args.run_dir, name="bench", config=EngineConfig(**fields))
    vocab, c = engine.vocab_size, args.concurrency
    lengths = length_mix(max(4, c), seed=c, quick=False)
    if not args.no_warm_up:
        warm = replay(engine, prompts_for(lengths, seed=10_000 + c, vocab=vocab), "warm")
        print(f"warm-up: {warm['wall_s']:.1f} s, programs {engine.runner.num_programs}", file=sys.stderr)
    report = replay(engine, prompts_for(lengths, seed=c, vocab=vocab), "timed")
    report.update(load_average=os.getloadavg(), settings=str(engine.settings), programs=engine.runner.programs,
                  kernels=fields.get("kernels"), ragged_steps=engine.ragged_steps)
    summary = {k: v for k, v in report.items() if k != "per_step"}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
