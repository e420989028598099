"""Utilization: achieved FLOP/s of axcore's train step against a measured float32 matmul peak.

FLOPs of one step of the benchmark decoder (L layers, model dim d, FFN F, vocab V,
batch B, sequence T), counted as matmul multiply-adds x 2:

    N_matmul  = L (4 d^2 + 2 d F) + d V        (q, k, v, o, up, down; the head; the
                                                 embedding lookup is a gather, not counted)
    dense     = 6 N_matmul B T                  (2 forward + 4 backward per weight and token)
    attention = 12 L B T^2 d                    (q k^T and p v, 2 B T^2 d each forward, x3
                                                 for forward + backward; the full T x T square,
                                                 as XLA's reference kernel computes it)
    total     = dense + attention

`total_causal_half` counts attention at half (the useful causal triangle). The result
also holds XLA's own cost analysis of the compiled step (all ops, elementwise too) and
the FLOPs of every dot in the compiled HLO.

The peak is a jitted 2048 x 2048 @ 2048 x 2048 float32 matmul (three per timing).
Contenders alternate round by round (matmul, axcore step, pure-JAX step, and the
breakdown pieces), and utilization is the median of per-round
`(step FLOPs / step time) / (matmul FLOPs / matmul time)`, so load on the machine
hits both sides alike. Target: >= 50% for axcore's default (RoPE) model.

Where the time goes, from the same rounds: the forward alone, forward + backward
(no optimizer), and the step's own matmuls replayed alone (every dot of the compiled
step, timed per distinct shape and multiplied by its count); plus a `jax.profiler`
trace of the step whose per-op times are summed by fusion kind (plain Eigen `dot`
thunks finish asynchronously, so the trace under-counts them; the dot replay above
is the matmul figure to trust).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import alternate, summarize, timed, write_result
from benchmarks.pure_jax_model import SMOKE_SHAPE, ModelShape

TARGET = 0.50
PEAK_SIZE, PEAK_REPEATS = 2048, 3


def step_flops(shape: ModelShape) -> dict[str, Any]:
    """The FLOP count of one train step by the formula in the module docstring."""
    L, d, F, V, B, T = shape.layers, shape.dim, shape.ffn, shape.vocab, shape.batch, shape.seq
    n_matmul = L * (4 * d * d + 2 * d * F) + d * V
    dense = 6 * n_matmul * B * T
    attention = 12 * L * B * T * T * d
    return {
        "formula": "6 * N_matmul * B * T + 12 * L * B * T^2 * d; N_matmul = L*(4d^2 + 2dF) + dV",
        "n_matmul_params": n_matmul,
        "tokens": B * T,
        "dense": dense,
        "attention_full_square": attention,
        "total": dense + attention,
        "total_causal_half": dense + attention // 2,
    }


# -- The compiled step's dots ---------------------------------------------------------

_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*)$")


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return tuple(int(x) for x in m.group(1).split(",") if x) if m else ()


def hlo_dots(hlo_text: str) -> list[dict[str, Any]]:
    """Every dot of a compiled HLO module (entry and fused computations), counted by config."""
    shapes: dict[str, tuple[int, ...]] = {}
    found = collections.Counter()
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):
            shapes = {}  # A new computation: names are local to it.
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, _, dims, opcode, rest = m.groups()
        shapes[name] = tuple(int(x) for x in dims.split(",") if x)
        if opcode != "dot":
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        lhs, rhs = shapes[operands[0]], shapes[operands[1]]
        key = (
            lhs, rhs,
            _dims(rest, "lhs_batch_dims"), _dims(rest, "lhs_contracting_dims"),
            _dims(rest, "rhs_batch_dims"), _dims(rest, "rhs_contracting_dims"),
        )
        found[key] += 1
    dots = []
    for (lhs, rhs, lb, lc, rb, rc), count in found.items():
        batch = int(np.prod([lhs[i] for i in lb]))
        contract = int(np.prod([lhs[i] for i in lc]))
        lhs_free = int(np.prod([n for i, n in enumerate(lhs) if i not in lb + lc]))
        rhs_free = int(np.prod([n for i, n in enumerate(rhs) if i not in rb + rc]))
        flops = 2 * batch * contract * lhs_free * rhs_free
        dots.append({"lhs": lhs, "rhs": rhs, "dims": (lb, lc, rb, rc), "count": count, "flops_each": flops})
    return sorted(dots, key=lambda d: -d["flops_each"] * d["count"])


def dot_replay(dots: list[dict[str, Any]]) -> Callable[[], float]:
    """A timing function: every dot alone (each distinct config once, times its count), in seconds."""
    runs = []
    keys = iter(jax.random.split(jax.random.key(1), 2 * len(dots)))
    for d in dots:
        lb, lc, rb, rc = d["dims"]
        f = jax.jit(lambda a, b, lc=lc, rc=rc, lb=lb, rb=rb: jax.lax.dot_general(a, b, ((lc, rc), (lb, rb))))
        a = jax.random.normal(next(keys), d["lhs"], jnp.float32)
        b = jax.random.normal(next(keys), d["rhs"], jnp.float32)
        f(a, b).block_until_ready()
        runs.append((f, a, b, d))

    def replay() -> float:
        total = 0.0
        for f, a, b, d in runs:
            seconds = timed(lambda f=f, a=a, b=b: f(a, b).block_until_ready())
            d.setdefault("seconds", []).append(seconds)
            total += seconds * d["count"]
        return total

    return replay


# -- Profile ----------------------------------------------------------------------------


def _fusion_callees(hlo_text: str) -> dict[str, str]:
    """Entry instruction name -> a short description of what it computes."""
    out = {}
    for m in re.finditer(r"^\s+%([\w.\-]+) = (\S+) (fusion|dot|copy|transpose)\(.*?op_name=\"([^\"]*)\"", hlo_text, re.MULTILINE):
        out[m.group(1)] = f"{m.group(2).split('{')[0]} {m.group(4).split('/', 1)[-1]}"
    return out


def profile_ops(run_step: Callable[[], Any], hlo_text: str, steps: int) -> dict[str, Any]:
    """Per-op traced thread time (ms per step) of `run_step`, summed by fusion kind, and the top ops."""
    from jax.profiler import ProfileData

    directory = tempfile.mkdtemp(prefix="axcore-profile-")
    try:
        jax.profiler.start_trace(directory)
        for _ in range(steps):
            run_step()
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0])
        per_op = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if "XLAEigen" not in line.name:
                    continue
                for event in line.events:
                    if not event.name.startswith(("ThunkExecutor", "SlinkyThreadPool")):
                        per_op[event.name] += event.duration_ns / steps / 1e6
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    what = _fusion_callees(hlo_text)
    kinds = collections.Counter()
    for name, ms in per_op.items():
        kinds[re.sub(r"\.\d+$", "", name)] += ms
    return {
        "traced_thread_ms_per_step": round(sum(per_op.values()), 1),
        "by_kind_ms": {k: round(v, 1) for k, v in kinds.most_common(12)},
        "top_ops": [
            {"op": name, "ms": round(ms, 2), "what": what.get(name, "")} for name, ms in per_op.most_common(15)
        ],
    }


# -- The benchmark ------------------------------------------------------------------------


def run(smoke: bool = False, results_dir: pathlib.Path | None = None) -> dict[str, Any]:
    from axcore.module import functional
    from benchmarks.step_time import build_contenders, corpus_batches

    shape = SMOKE_SHAPE if smoke else ModelShape()
    load_start = os.getloadavg()
    warmup, rounds = (1, 2) if smoke else (2, 12)
    size = 256 if smoke else PEAK_SIZE
    flops = step_flops(shape)
    contenders, experiment = build_contenders(shape, with_scan=False, with_flax=False)
    axcore, pure = contenders["axcore"], contenders["pure_jax"]
    trainer = axcore.trainer
    batch_host = corpus_batches(experiment, 1)[0]
    batch = {name: c.place(batch_host) for name, c in contenders.items()}

    # The pieces: the same model's forward, and forward + backward, on a copy of the parameters.
    params = jax.tree.map(jnp.copy, axcore.state()["params"])
    key = jax.random.key(0)

    def loss(p, b):
        (value, _), _ = functional(trainer.step.model, p, (b,), key, True)
        return value

    forward = jax.jit(loss)
    forward_backward = jax.jit(jax.value_and_grad(loss))

    # The peak: a square float32 matmul.
    a = jax.random.normal(jax.random.key(2), (size, size), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul_flops = 2 * size**3 * PEAK_REPEATS

    def peak() -> float:
        def three():
            for _ in range(PEAK_REPEATS):
                out = matmul(a, a)
            out.block_until_ready()

        return timed(three)

    step_hlo = axcore.compiled().as_text()
    dots = hlo_dots(step_hlo)
    fns = {
        "matmul_peak": peak,
        "axcore_step": lambda: timed(lambda: axcore.step(batch["axcore"]).block_until_ready()),
        "pure_jax_step": lambda: timed(lambda: pure.step(batch["pure_jax"]).block_until_ready()),
        "axcore_forward": lambda: timed(lambda: forward(params, batch["axcore"]).block_until_ready()),
        "axcore_forward_backward": lambda: timed(lambda: jax.block_until_ready(forward_backward(params, batch["axcore"]))),
        "axcore_step_dots_alone": dot_replay(dots),
    }
    alternate(fns, warmup)
    for d in dots:
        d.pop("seconds", None)
    times = alternate(fns, rounds)
    stats = {name: summarize(t) for name, t in times.items()}
    peak_rate = [matmul_flops / t for t in times["matmul_peak"]]

    def utilization(name: str) -> dict[str, float]:
        return summarize([flops["total"] / t / p for t, p in zip(times[name], peak_rate)])

    util = {"axcore": utilization("axcore_step"), "pure_jax": utilization("pure_jax_step")}
    cost = axcore.compiled().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    dot_flops = sum(d["flops_each"] * d["count"] for d in dots)
    step_median = stats["axcore_step"]["median"]
    breakdown = {
        "step_s": step_median,
        "forward_s": stats["axcore_forward"]["median"],
        "forward_backward_s": stats["axcore_forward_backward"]["median"],
        "optimizer_and_metrics_s": step_median - stats["axcore_forward_backward"]["median"],
        "dots_alone_s": stats["axcore_step_dots_alone"]["median"],
        "non_dot_s": step_median - stats["axcore_step_dots_alone"]["median"],
        "dots_share_of_step": stats["axcore_step_dots_alone"]["median"] / step_median,
    }
    dot_table = [
        {
            "lhs": list(d["lhs"]),
            "rhs": list(d["rhs"]),
            "count": d["count"],
            "gflop_each": round(d["flops_each"] / 1e9, 4),
            "ms_each": round(1e3 * float(np.median(d["seconds"])), 3),
            "gflops_per_s": round(d["flops_each"] / float(np.median(d["seconds"])) / 1e9, 1),
        }
        for d in dots
    ]
    profile = profile_ops(lambda: axcore.step(batch["axcore"]).block_until_ready(), step_hlo, 1 if smoke else 3)
    result = {
        "smoke": smoke,
        "load_average_1min": {"start": load_start[0], "end": os.getloadavg()[0]},
        "model": dataclasses.asdict(shape),
        "flops_per_step": flops,
        "xla_cost_analysis_flops": float(cost.get("flops", 0.0)),
        "hlo_dot_flops": dot_flops,
        "matmul_peak": {
            "size": size,
            "gflops_per_s_median": float(np.median(peak_rate)) / 1e9,
            "gflops_per_s_max": float(np.max(peak_rate)) / 1e9,
        },
        "rounds": rounds,
        "times_s": stats,
        "achieved_gflops_per_s": {
            "axcore": flops["total"] / step_median / 1e9,
            "pure_jax": flops["total"] / stats["pure_jax_step"]["median"] / 1e9,
        },
        "utilization": util,
        "utilization_causal_half": {
            k: v["median"] * flops["total_causal_half"] / flops["total"] for k, v in util.items()
        },
        "targets": {
            "axcore_utilization": {
                "metric": "median of per-round (formula FLOPs / step time) / (matmul FLOPs / matmul time)",
                "target": f">= {TARGET}",
                "value": util["axcore"]["median"],
                "met": util["axcore"]["median"] >= TARGET,
            }
        },
        "breakdown": breakdown,
        "dots": dot_table,
        "profile": profile,
    }
    result["headlines"] = [
        {"metric": "float32 matmul peak (GFLOP/s, median)", "value": round(result["matmul_peak"]["gflops_per_s_median"], 1)},
        {"metric": "axcore step achieved (GFLOP/s, formula)", "value": round(result["achieved_gflops_per_s"]["axcore"], 1)},
        {
            "metric": "axcore utilization (median of per-round ratios)",
            "value": f"{util['axcore']['median']:.1%}",
            "target": f">= {TARGET:.0%}",
            "passed": util["axcore"]["median"] >= TARGET,
        },
        {"metric": "pure-JAX utilization (median of per-round ratios)", "value": f"{util['pure_jax']['median']:.1%}"},
        {"metric": "axcore step: share of time its dots take alone", "value": f"{breakdown['dots_share_of_step']:.0%}"},
    ]
    write_result("utilization", result, results_dir=results_dir)
    return result
