"""The result of one `benchmarks.gpu_step` phase: its JSON payload and the memory figures in it.

Per contender the result holds the median step time (and p10/p90), tokens/s, MFU,
peak device memory (`memory_stats()["peak_bytes_in_use"]`; null where the backend has
none, e.g. CPU), XLA's memory analysis of the compiled step, and the dtypes of every
matmul: `requested` counts the `dot_general`s of the traced step by operand and result
dtype (what the program asks for); `compiled` counts the matmuls of the optimized HLO
(`dot` instructions, also those inside Triton or cuDNN GEMM fusions, `convolution`, and
cuBLAS custom calls) by operand and result dtype (what the backend runs; XLA:CPU runs
most bfloat16 dots in float32), plus every custom-call target (cuDNN attention appears
as `__cudnn$fmha...`).

Peak memory: axcore's state is built and its first step run while nothing else is
on the device (only the compilers' autotuning scratch came before), so its
`peak_bytes_in_use` is its own; pure JAX's is the process peak after its first step
minus what axcore held when pure JAX's state was built (exact when it raised the
process peak; otherwise an upper bound, flagged `peak_bytes_exact: false`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from benchmarks.step_accounting import LOSS_RTOL, flops_per_step, headlines, hlo_matmuls, jaxpr_dots, peak_tflops

if TYPE_CHECKING:
    from benchmarks.gpu_step import Contender, Setup
    from benchmarks.llama_jax import LlamaShape

# Environment variables recorded in each result.
ENV_KEYS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS")


def device_memory() -> dict[str, int] | None:
    """Device 0's `bytes_in_use`, `peak_bytes_in_use`, `bytes_limit` (None where the backend keeps no stats)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return None if not stats else {k: int(stats[k]) for k in keys if k in stats}


def compiled_memory(compiled) -> dict[str, int] | None:
    """XLA's memory analysis of a compiled step: its argument, output, alias, temp sizes and peak, in bytes."""
    from axcore.trainer.memory_check import memory_analysis

    analysis = memory_analysis(compiled)
    if not analysis:
        return None
    sizes = ("argument", "output", "alias", "temp")
    fields = (*(f"{size}_size_in_bytes" for size in sizes), "peak_memory_in_bytes")
    return {f: analysis[f] for f in fields if f in analysis}


def phase_result(args, shape: LlamaShape, s: Setup, contenders: dict[str, Contender], times, memory) -> dict[str, Any]:
    """The phase's JSON payload (module docstring)."""
    import jax
    import numpy as np

    from benchmarks.common import pairwise_ratio, summarize

    flops = flops_per_step(shape)
    platform = jax.default_backend()
    peak, peak_source = peak_tflops(jax.devices()[0].device_kind, platform, args.peak_tflops)
    peaks, notes = own_peaks(memory), list(s.notes)
    curves = {name: [float(x) for x in c.losses] for name, c in contenders.items()}
    results = {}
    for name, c in contenders.items():
        step_s = summarize(times[name])
        per_s = 1.0 / step_s["median"]
        results[name] = {
            "attention": c.attention,
            "num_params": c.num_params,
            "compile_s": c.compile_s,
            "step_time_s": step_s,
            "tokens_per_s": shape.batch * shape.seq * per_s,
            "achieved_tflops": flops["total"] * per_s / 1e12,
            "mfu": None if peak is None else flops["total"] * per_s / (peak * 1e12),
            "mfu_full_square": None if peak is None else flops["total_full_square"] * per_s / (peak * 1e12),
            "peak_bytes_in_use": peaks[name]["bytes"],
            "peak_bytes_exact": peaks[name]["exact"],
            "compiled_memory": compiled_memory(c.compiled),
            "first_step_loss": curves[name][0],
            "losses": curves[name],
            "dots": {"requested": jaxpr_dots(c.jaxpr), **hlo_matmuls(c.compiled.as_text())},
        }
        fmha = sum(n for target, n in results[name]["dots"]["custom_calls"].items() if "fmha" in target)
        if (c.attention == "cudnn") != (fmha > 0):
            notes.append(f"{name} runs attention '{c.attention}' but its compiled step has {fmha} cuDNN fmha calls.")
    if contenders["axcore"].num_params != shape.num_params():
        notes.append(f"axcore has {contenders['axcore'].num_params} parameters; LlamaShape says {shape.num_params()}.")
    first = (curves["axcore"][0], curves["pure_jax"][0])
    first_rel = abs(first[0] - first[1]) / abs(first[1])
    rel = np.abs(np.subtract(curves["axcore"], curves["pure_jax"])) / np.abs(curves["pure_jax"])
    cfg = s.experiment.config
    result = {
        "smoke": args.smoke,
        "attention": {"requested": s.attention, "axcore_kernel": s.kernel, "pure_jax": s.pure_attention},
        "model": {**dataclasses.asdict(shape), "head_dim": shape.head_dim, "num_params": shape.num_params()},
        "dtypes": {"param": str(np.dtype(cfg.model.param_dtype or "float32")), "compute": str(s.compute_dtype)},
        "hyper": dataclasses.asdict(s.hyper),
        "axcore_plugins": s.plugins,
        "warmup_steps": args.warmup,
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "flops_per_step": flops,
        "peak_tflops": peak,
        "peak_source": peak_source,
        "contenders": results,
        "ratio_axcore_over_pure_jax": pairwise_ratio(times["axcore"], times["pure_jax"]),
        "first_step_loss_rel_diff": first_rel,
        "loss_rtol": LOSS_RTOL,
        "first_step_losses_agree": first_rel <= LOSS_RTOL,
        "loss_max_rel_diff_all_steps": float(rel.max()),
        "memory_stats": memory,
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "load_average_1min": os.getloadavg()[0],
        "notes": notes,
    }
    result["headlines"] = headlines(result)
    return result


def own_peaks(memory: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each contender's own peak device bytes (module docstring); None where the backend keeps no stats."""
    before, ax, pure = memory["after_compiles"], memory["after_axcore_first_step"], memory["after_pure_first_step"]
    if not (before and ax and pure) or "peak_bytes_in_use" not in ax:
        return {"axcore": {"bytes": None, "exact": None}, "pure_jax": {"bytes": None, "exact": None}}
    return {
        "axcore": {"bytes": ax["peak_bytes_in_use"], "exact": ax["peak_bytes_in_use"] > before["peak_bytes_in_use"]},
        "pure_jax": {
            "bytes": pure["peak_bytes_in_use"] - ax["bytes_in_use"],
            "exact": pure["peak_bytes_in_use"] > ax["peak_bytes_in_use"],
        },
    }
